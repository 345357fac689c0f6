"""Under plain torchrun: a killed worker, peerckpt against a restart from a DCP checkpoint.

    python bench/torchrun.py [--sizes 64,256] [--runs 2] [--quick]

The same job (``bench/jobs/torchrun_job.py``: a small DDP model stepping, and M MiB of
frozen state per rank) runs under ``torchrun --nnodes=2 --nproc-per-node=2 --max-restarts=3``
on two "hosts" of this machine (``tests/torchrun_hosts.py``: one torchrun each, on 127.0.0.2
and 127.0.0.3), twice per run, in one run of this script:

* **peerckpt** (``peerckpt_s``): the function is ``@peerckpt.resilient``; after the kill
  torchrun restarts every worker, and each restores its rank from its own host's memory;
* **DCP** (``dcp_s``): a plain torchrun script that saves the same state with
  ``torch.distributed.checkpoint`` to local disk after every step; after the kill torchrun
  restarts every worker, which drop the checkpoint's files from the page cache
  (``posix_fadvise(DONTNEED)`` after an ``fsync``: no root needed, so it is done on every
  machine) and ``dcp.load`` it.

After a few steps one worker of the second host is SIGKILLed. Timed from the kill to every
rank stepping again: the last of the four restarted processes' first completed step (each
process writes a wall-clock time per step). Both restart from the step before the kill, so
no work is lost in either; what differs is where the state comes from. torchrun's own part
(noticing the exit, stopping the other workers, a new rendezvous, starting four Pythons
that import torch) is in both. ``speedup`` is ``dcp_s / peerckpt_s``, printed per size.
Results: ``bench/results/torchrun.json``.
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    HEARTBEAT_TIMEOUT_S,
    REPO,
    background_load,
    bench_parser,
    job_name,
    leftover_segments,
    scratch_dir,
    write_result,
)

sys.path.insert(0, str(REPO))
from tests.torchrun_hosts import TorchrunJob, runtime_dirs

JOB = REPO / "bench" / "jobs" / "torchrun_job.py"
WORLD = 4
KILL_AFTER_STEPS = 6  # steps every rank completed before the kill


def _lines(out: Path) -> list[dict[str, Any]]:
    path = out / "steps.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _why(job: TorchrunJob) -> str:
    """peerckpt's warnings and errors from the hosts' logs, and the end of the logs."""
    lines = [x for x in job.log().splitlines() if "peerckpt[" in x and ("WARN" in x or "ERR" in x)]
    return "\n".join(lines[-40:]) + "\n...\n" + job.log()[-2000:]


def one_run(mode: str, mib: int, base: Path, steps: int) -> dict[str, Any]:
    """Run the job under torchrun in ``mode``, kill a worker, time every rank stepping again."""
    out = base / f"{mode}-{mib}-{time.monotonic_ns()}"
    args = [str(out), "--mode", mode, "--mib", str(mib), "--steps", str(steps)]
    if mode == "dcp":
        args += ["--ckpt", str(out / "ckpt")]
    name = job_name("btr")
    env = {"PEERCKPT_HEARTBEAT_TIMEOUT": HEARTBEAT_TIMEOUT_S, "PEERCKPT_LOG_LEVEL": "INFO"}
    job = TorchrunJob(out, name, JOB, args, nnodes="2", nproc=2, env=env)
    try:
        deadline = time.monotonic() + 600
        while len(_lines(out)) < WORLD * KILL_AFTER_STEPS:
            if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
                raise RuntimeError(f"{mode}: the job did not start:\n{_why(job)}")
            time.sleep(0.02)
        before = {line["pid"] for line in _lines(out)}
        killed_at = time.time()
        job.kill_worker(1)
        codes = job.wait(600)
    finally:
        job.stop()
    if codes != [0, 0]:
        raise RuntimeError(f"{mode}: torchrun exited {codes}:\n{_why(job)}")
    report = job.report() if mode == "peerckpt" else {}
    first: dict[int, float] = {}  # restarted process → its first step's end
    for line in _lines(out):
        if line["pid"] not in before:
            first[line["pid"]] = min(first.get(line["pid"], line["t"]), line["t"])
    if len(first) != WORLD:
        raise RuntimeError(f"{mode}: {len(first)} restarted processes stepped, not {WORLD}")
    row: dict[str, Any] = {"stepping_again_s": max(first.values()) - killed_at}
    if report:
        [event] = report["events"]
        row["pulled_bytes"] = sum(p["bytes"] for p in event["pulls"])
        row["detected_after_s"] = event["detected_at"] - killed_at
        # From the loss until every restarted worker had joined (torchrun's restart, the new
        # processes' imports); what is left of stepping_again_s is peerckpt's own part.
        row["waited_for_restart_s"] = event.get("waited_for_spares_s")
    left = leftover_segments(name) + runtime_dirs(name)
    if left:
        raise RuntimeError(f"{mode}: the job left {left} behind")
    return row


def main() -> None:
    # A SIGTERM (a timeout around the bench) unwinds like an error, so every job's
    # ``finally: job.stop()`` kills its torchruns and their workers (they run in sessions of
    # their own and would outlive this process).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = bench_parser(__doc__)
    parser.add_argument("--sizes", default="64,256", help="MiB of state per rank")
    args = parser.parse_args()
    sizes = [16] if args.quick else [int(x) for x in args.sizes.split(",")]
    runs = 1 if args.quick else args.runs
    load = background_load()
    print(f"background load before starting: {load}", flush=True)
    result: dict[str, Any] = {
        "quick": args.quick,
        "runs": runs,
        "world": "2 hosts × 2 workers (torchrun --nnodes=2 --nproc-per-node=2)",
        "page_cache": "dropped before dcp.load (fsync + posix_fadvise DONTNEED per file)",
        "sizes": {},
    }
    with scratch_dir("torchrun") as scratch:
        for mib in sizes:
            rows: dict[str, list[dict[str, Any]]] = {"peerckpt": [], "dcp": []}
            for _ in range(runs):
                for mode in ("peerckpt", "dcp"):
                    rows[mode].append(
                        one_run(mode, mib, Path(scratch), steps=KILL_AFTER_STEPS + 14)
                    )
                    print(f"  {mib} MiB {mode}: {rows[mode][-1]}", flush=True)
            peer = statistics.median(r["stepping_again_s"] for r in rows["peerckpt"])
            dcp = statistics.median(r["stepping_again_s"] for r in rows["dcp"])
            result["sizes"][f"{mib}MiB"] = {
                "peerckpt_s": peer,
                "dcp_s": dcp,
                "speedup": dcp / peer,
                "peerckpt_runs": rows["peerckpt"],
                "dcp_runs": rows["dcp"],
            }
            print(
                f"{mib} MiB per rank: kill → every rank stepping again: peerckpt {peer:.2f} s, "
                f"DCP restart {dcp:.2f} s: {dcp / peer:.2f}×",
                flush=True,
            )
    path = write_result("torchrun", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
