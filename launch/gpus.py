"""Several ranks on one GPU: what NCCL needs to let them form a communicator.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected",
NVIDIA/nccl#418): it tells ranks apart by host hash and bus id. Each process given its own
``NCCL_HOSTID`` counts as a host of its own, and its ranks then talk over NCCL's socket
transport (shared memory and peer-to-peer disabled: they assume one host). That is how a
``peerckpt run`` of simulated nodes runs more NCCL ranks than the machine has GPUs — the GPU
tests run 4 ranks on one — and how public projects test data-parallel jobs on one GPU.

Pure; the launcher applies it (``ProcessSet.share_gpus``) only when its ranks outnumber the
GPUs it sees, so a machine with a GPU per rank keeps NCCL's fast transports.
"""

from __future__ import annotations

import glob
import os


def visible_gpus(environ: dict[str, str] | None = None, root: str = "/") -> int:
    """How many NVIDIA GPUs this machine's processes see: ``CUDA_VISIBLE_DEVICES`` when set,
    else the devices the driver lists in /proc (0 without a driver), else its GPU device
    files ``/dev/nvidia0``, … (a sandbox such as gVisor proxies the device files but may
    show no /proc/driver/nvidia). No CUDA initialisation."""
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = [e for e in listed.split(",") if e.strip()]
        return 0 if not entries or entries[0].strip() == "-1" else len(entries)
    driver = glob.glob(os.path.join(root, "proc/driver/nvidia/gpus/*"))
    return len(driver) or len(glob.glob(os.path.join(root, "dev/nvidia[0-9]*")))


def sharing_env(job: str, node: int, seq: int) -> dict[str, str]:
    """The environment of the ``seq``-th process started on ``node`` when ranks share GPUs."""
    return {
        "NCCL_HOSTID": f"peerckpt-{job}-n{node}-p{seq}",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_P2P_DISABLE": "1",
    }
