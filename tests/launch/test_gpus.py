"""Several NCCL ranks on one GPU (``launch/gpus.py``): each training process a host
of its own for NCCL, only where ranks outnumber the GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from peerckpt.launch.gpus import sharing_env, visible_gpus
from peerckpt.launch.processes import Node, ProcessSet, wait_all
from peerckpt.states import ProcRole

RECORD = """
import json, os, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({k: os.environ.get(k) for k in
                        ("NCCL_HOSTID", "NCCL_SHM_DISABLE", "NCCL_P2P_DISABLE")}) + "\\n")
"""


def test_the_gpus_seen_come_from_cuda_visible_devices_first() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0"}) == 1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,3"}) == 3
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == 0


def test_without_cuda_visible_devices_the_driver_counts_them(tmp_path: Path) -> None:
    assert visible_gpus({}, root=str(tmp_path)) == 0
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"):
        (tmp_path / "dev").mkdir(exist_ok=True)
        (tmp_path / "dev" / name).touch()
    assert visible_gpus({}, root=str(tmp_path)) == 2  # no /proc/driver/nvidia (gVisor)
    gpus = tmp_path / "proc" / "driver" / "nvidia" / "gpus"
    (gpus / "0000:04:00.0").mkdir(parents=True)
    assert visible_gpus({}, root=str(tmp_path)) == 1  # the driver's own list first
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2"}, root=str(tmp_path)) == 3


def test_processes_sharing_a_gpu_are_each_an_nccl_host_of_their_own(tmp_path: Path) -> None:
    script, record = tmp_path / "proc.py", tmp_path / "record.jsonl"
    script.write_text(RECORD)
    procs = ProcessSet("job", b"s", [str(script), str(record)], str(tmp_path), {})
    procs.share_gpus = True
    agents = []
    for n in (0, 1):
        agents.append(subprocess.Popen([sys.executable, "-c", "pass"]))
        procs.nodes[n] = Node(n, agents[-1], "sock")
        procs.start_proc(n, ProcRole.RANK)
        procs.start_proc(n, ProcRole.RANK)
    wait_all([p for n in (0, 1) for p in procs.nodes[n].procs] + agents, 30.0)
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    assert len({s["NCCL_HOSTID"] for s in seen}) == 4  # two ranks of a node differ too
    assert all(s["NCCL_SHM_DISABLE"] == s["NCCL_P2P_DISABLE"] == "1" for s in seen)
    assert sharing_env("job", 0, 1) != sharing_env("job", 0, 2)


def test_without_sharing_nccl_is_left_alone(tmp_path: Path) -> None:
    script, record = tmp_path / "proc.py", tmp_path / "record.jsonl"
    script.write_text(RECORD)
    procs = ProcessSet("job", b"s", [str(script), str(record)], str(tmp_path), {})
    agent = subprocess.Popen([sys.executable, "-c", "pass"])
    procs.nodes[0] = Node(0, agent, "sock")
    procs.start_proc(0, ProcRole.RANK)
    wait_all([*procs.nodes[0].procs, agent], 30.0)
    [seen] = [json.loads(line) for line in record.read_text().splitlines()]
    assert seen["NCCL_HOSTID"] is None
