"""The CUDA snapshot path: how fast device state reaches the slot, and what training pays.

    python bench/gpu.py [--sizes 256,1024] [--steps 40] [--runs 5] [--step-ms 200]

Needs a CUDA device (it exits saying so without one; CI has none). One run measures:

* the device-to-host ceilings for 1 GiB: into page-locked memory from torch's allocator
  (the copy engine's speed), into pageable memory, and into a shared-memory mapping
  registered with ``cudaHostRegister`` (what a snapshot slot is);
* a 1-rank CUDA training loop (``bench/jobs/gpu_job.py``: an MLP whose parameters and AdamW
  state hold each size, the batch chosen so that a step takes about ``--step-ms``), without
  peerckpt and under ``peerckpt run`` with a snapshot of the whole state every step; the
  median step time of each (first quarter of the steps dropped as warm-up), ``--runs`` times.

With ``--nccl`` also the 4-rank NCCL job on one GPU (a killed rank and a killed node against
the fault-free run) and the pull of 1 GiB from a holder agent over NCCL and over TCP
(``pull``: ``bytes``, ``nccl_gbps``, ``tcp_gbps``, ``ratio``, ``bit_exact``, and which
transport carried each), into
``bench/results/gpu-nccl.json``.

Results: ``bench/results/gpu.json``; keys per size ``step_s_plain``, ``step_s_peerckpt``,
``stall_fraction`` ((peerckpt − plain) / plain), ``snapshot_gbps_needed`` (state / step time),
and ``d2h_gbps`` (pinned, pageable, registered shm).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "jobs"))
from common import median_of, run_peerckpt, scratch_dir, start_peerckpt, write_result

JOB = Path(__file__).resolve().parent / "jobs" / "gpu_job.py"


def d2h_gbps(dst: torch.Tensor, src: torch.Tensor, runs: int = 5) -> float:
    def once() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return src.numel() / (time.perf_counter() - start) / 1e9

    once()
    return median_of(runs, once)[0]


def ceilings(nbytes: int = 1 << 30) -> dict[str, float]:
    from peerckpt.runtime import cuda_copy

    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(0)
    result = {"pinned": d2h_gbps(pinned, src), "pageable": d2h_gbps(pageable, src)}
    del pinned, pageable
    with open("/dev/shm/peerckpt-bench-gpu", "w+b") as f:
        f.truncate(nbytes)
        mm = mmap.mmap(f.fileno(), nbytes)
    try:
        shm = torch.frombuffer(mm, dtype=torch.uint8)
        shm.fill_(0)
        if cuda_copy.pin(shm):
            result["registered_shm"] = d2h_gbps(shm, src)
            cuda_copy.unpin(shm)
        del shm
    finally:
        mm.close()
        Path("/dev/shm/peerckpt-bench-gpu").unlink()
    return result


def calibrate(mib: int, step_s: float) -> int:
    """The batch at which one training step of the ``mib`` model takes about ``step_s``."""
    import gpu_job

    torch.backends.cuda.matmul.allow_tf32 = False
    model = gpu_job.build(mib)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    hidden = model[0].in_features
    batch = 1024
    while True:
        x = torch.randn(batch, hidden, device="cuda")
        gpu_job.train_step(model, optim, x)
        start = time.perf_counter()
        for _ in range(3):
            gpu_job.train_step(model, optim, x)
        took = (time.perf_counter() - start) / 3
        if took >= step_s / 4 or batch >= 1 << 20:
            break
        batch *= 2
    del model, optim
    torch.cuda.empty_cache()
    return max(1, int(batch * step_s / took))


def steady(times: list[float]) -> float:
    return statistics.median(times[len(times) // 4 :])


def run_size(mib: int, batch: int, steps: int, runs: int) -> dict[str, Any]:
    plain, peer, stalls = [], [], []
    for _ in range(runs):
        with scratch_dir("gpu") as tmp:
            out = Path(tmp)
            common = [str(out), "--mib", str(mib), "--batch", str(batch), "--steps", str(steps)]
            subprocess.run([sys.executable, str(JOB), *common, "--plain"], check=True)
            run_peerckpt(["--nodes", "1", "--nproc-per-node", "1", str(JOB), *common])
            a = json.loads((out / "steps-plain.json").read_text())
            b = json.loads((out / "steps-peerckpt.json").read_text())
        plain.append(steady(a["times"]))
        peer.append(steady(b["times"]))
        stalls.append(b["stall_s"] / len(b["times"]))
    step_plain, step_peer = statistics.median(plain), statistics.median(peer)
    return {
        "state_bytes": a["state_bytes"],
        "batch": batch,
        "step_s_plain": step_plain,
        "step_s_peerckpt": step_peer,
        "stall_fraction": (step_peer - step_plain) / step_plain,
        "optimizer_hook_wait_s": statistics.median(stalls),
        "snapshot_gbps_needed": a["state_bytes"] / step_plain / 1e9,
        "runs_plain": plain,
        "runs_peerckpt": peer,
    }


TESTS_JOBS = Path(__file__).resolve().parent.parent / "tests" / "jobs"
NCCL_ARGS = ["--steps", "30", "--device", "cuda", "--backend", "cpu:gloo,cuda:nccl"]
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) peerckpt\[rank=(\d+)")


def _nccl_job(out: Path, chaos: str = "", spares: int = 0) -> tuple[dict[str, Any], str]:
    """The DDP test job on 4 NCCL ranks sharing this machine's GPU (2 simulated nodes × 2);
    its report and log."""
    out.mkdir(parents=True)
    argv = ["--nodes", "2", "--nproc-per-node", "2", "--spares", str(spares)]
    argv += ["--report", str(out / "report.json")]
    argv += ["--chaos", chaos] if chaos else []
    launcher = start_peerckpt([*argv, str(TESTS_JOBS / "ddp_job.py"), str(out), *NCCL_ARGS], "INFO")
    try:
        stdout, stderr = launcher.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        launcher.terminate()  # the launcher stops and cleans up its job
        stdout, stderr = launcher.communicate(timeout=60)
    log = stdout + stderr
    if launcher.returncode != 0:
        # The whole log where the device tool brings files back ($OUT), the tail here.
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"nccl-{out.name}.log").write_text(log)
        raise RuntimeError(f"the {out.name} job failed ({launcher.returncode}):\n{log[-3000:]}")
    return json.loads((out / "report.json").read_text()), log


def _records(out: Path) -> list[tuple[int, dict[str, Any]]]:
    """(rank, record) for every step any process of the job recorded."""
    return [
        (int(path.stem[4:]), json.loads(line))
        for path in sorted(out.glob("rank*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def _compare(run: Path, reference: Path, at: int) -> dict[str, Any]:
    """Bit for bit against the fault-free run: every step trained again and the final state
    equal, every other record too except the survivors' step in flight when the peer died
    (epoch 0, step ``at``; NCCL's asynchronous all-reduce lets it finish on what the aborted
    kernel left before the next step boundary discards it: tests/gpu/digests.py)."""
    expected = {(rank, e["step"]): e["digest"] for rank, e in _records(reference)}
    records = _records(run)
    seen = {(rank, e["step"], e["digest"]) for rank, e in records}
    differing = [(r, e) for r, e in records if expected.get((r, e["step"])) != e["digest"]]
    in_flight = [r for r, e in differing if e["epoch"] == 0 and e["step"] == at]
    final = (run / "final.json").read_text() == (reference / "final.json").read_text()
    return {
        "bit_exact": final
        and all((rank, step, d) in seen for (rank, step), d in expected.items())
        and len(in_flight) == len(differing)
        and len(set(in_flight)) == len(in_flight),
        "in_flight_records": len(in_flight),
        "every_record_equal": not differing,
    }


def _released_s(log: str, fired_at: float) -> float | None:
    """From the chaos action to the last survivor's abort of its group (the log's clock)."""
    times = []
    for line in log.splitlines():
        match = _STAMP.match(line)
        if match and "aborted the process group of epoch" in line:
            stamp = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
            times.append(stamp + int(match.group(2)) / 1000 - fired_at)
    return max(times) if times else None


def nccl_job() -> dict[str, Any]:
    """Issue 28's figures: a killed rank and a killed node in a 4-rank NCCL job on one GPU,
    each against the fault-free run, bit for bit; release and recovery times."""
    out: dict[str, Any] = {"backend": "cpu:gloo,cuda:nccl", "ranks": 4}
    with scratch_dir("gpu-nccl") as tmp:
        base = Path(tmp)
        _nccl_job(base / "reference")
        for name, chaos, spares, at in (
            ("kill_rank", "kill rank=2 at=10", 1, 10),
            ("kill_node", "kill node=1 at=12", 2, 12),
        ):
            try:
                report, log = _nccl_job(base / name, chaos, spares)
            except RuntimeError as exc:  # recorded; the other kill still runs
                print(exc, flush=True)
                out[f"{name}_error"] = str(exc).splitlines()[0]
                out[f"{name}_bit_exact"] = False
                continue
            compared = _compare(base / name, base / "reference", at)
            out[f"{name}_bit_exact"] = compared["bit_exact"]
            out[f"{name}_in_flight_records"] = compared["in_flight_records"]
            out[f"{name}_every_record_equal"] = compared["every_record_equal"]
            [fired] = report["chaos"]
            [event] = report["events"]
            out[f"{name}_release_s"] = _released_s(log, fired["fired_at"])
            out[f"{name}_recovery_s"] = event["resumed_at"] - fired["fired_at"]
    releases = [out.get(f"{k}_release_s") for k in ("kill_rank", "kill_node")]
    recoveries = [out.get(f"{k}_recovery_s") for k in ("kill_rank", "kill_node")]
    out["release_s"] = None if None in releases else max(releases)  # type: ignore[type-var]
    out["recovery_s"] = None if None in recoveries else max(recoveries)  # type: ignore[type-var]
    return out


def pull(mib: int = 1024, runs: int = 2) -> dict[str, Any]:
    """Issue 29's figures: one rank's snapshot of ``mib`` MiB pulled from a holder agent's data
    plane (another process on this machine, ``tests/jobs/pull_holder.py``) over NCCL and over
    TCP, each the best of ``runs``, and whether every pull was bit-exact; ``nccl_gbps`` is None
    where the NCCL pull fell back to TCP (``nccl_carried_by``)."""
    import secrets

    sys.path.insert(0, str(TESTS_JOBS))
    import pull_holder

    from peerckpt.replication.transport import TransportMode

    job, secret = f"benchpull{os.getpid()}", secrets.token_bytes(32)
    holder = subprocess.Popen(
        [sys.executable, str(TESTS_JOBS / "pull_holder.py"), "--job", job, "--mib", str(mib)],
        env=dict(os.environ, PEERCKPT_SECRET=secret.hex()),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    out: dict[str, Any] = {"bytes": None, "bit_exact": True}
    try:
        assert holder.stdout is not None
        address = holder.stdout.readline().split()[1]
        for mode in (TransportMode.NCCL, TransportMode.TCP):
            best = None
            for _ in range(runs):
                how, seconds, same = pull_holder.pull(job, secret, address, mode, mib)
                out["bit_exact"] &= same
                best = seconds if best is None else min(best, seconds)
            out[f"{mode.value}_s"] = best
            out[f"{mode.value}_carried_by"] = how  # "tcp" for nccl: it fell back (see the log)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    out["bytes"] = pull_holder.snapshot_bytes(mib)[2]
    from peerckpt.replication.nccl import SOCKETS  # what the agents' links ran with

    out["nccl_socket_env"] = {k: os.environ.get(k, v) for k, v in SOCKETS.items()}
    out["tcp_gbps"] = out["bytes"] / out["tcp_s"] / 1e9
    if out["nccl_carried_by"] != "nccl":
        out["nccl_gbps"] = out["ratio"] = None
        return out
    out["nccl_gbps"] = out["bytes"] / out["nccl_s"] / 1e9
    out["ratio"] = out["nccl_gbps"] / out["tcp_gbps"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024", help="MiB of state per rank")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=200.0)
    parser.add_argument(
        "--nccl",
        action="store_true",
        help="also the NCCL job on one GPU and the pull (bench/results/gpu-nccl.json)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA device; this machine has none")
    nccl: dict[str, Any] = {}
    if args.nccl:
        nccl = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
        # Each part on its own, written as soon as it is measured: one lent try on a GPU
        # machine yields whatever parts ran, and a part that fails says why in the result.
        for part, measure in (("job", nccl_job), ("pull", pull)):
            try:
                nccl[part] = measure()
            except Exception as exc:  # recorded, with its trace, and the next part still runs
                traceback.print_exc()
                nccl[part] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"NCCL {part}: {nccl[part]}", flush=True)
            write_result("gpu-nccl", nccl)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "d2h_gbps": ceilings()}
    print(f"device-to-host 1 GiB, GB/s: {result['d2h_gbps']}", flush=True)
    for mib in map(int, args.sizes.split(",")):
        batch = calibrate(mib, args.step_ms / 1000)
        row = run_size(mib, batch, args.steps, args.runs)
        result[f"{mib}MiB"] = row
        print(
            f"{mib} MiB: step {row['step_s_plain'] * 1e3:.1f} ms plain, "
            f"{row['step_s_peerckpt'] * 1e3:.1f} ms with a snapshot every step "
            f"(stall {row['stall_fraction']:+.2%}; the optimizer hook waited "
            f"{row['optimizer_hook_wait_s'] * 1e3:.2f} ms per step)",
            flush=True,
        )
    path = write_result("gpu", result)
    print(f"wrote {path}")
    if args.nccl:  # with the CUDA stall of a snapshot every step, measured above
        nccl["stall"] = {k: v for k, v in result.items() if k.endswith("MiB")}
        print(f"wrote {write_result('gpu-nccl', nccl)}", flush=True)


if __name__ == "__main__":
    main()
