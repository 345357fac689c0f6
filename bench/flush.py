"""Durable flushes: do they slow training, and how close to the disk do they write?

    python bench/flush.py [--mib-per-rank 256] [--steps 60] [--every 10] [--runs 3]

One run measures, on this machine:

* the disk's raw write bandwidth: as many bytes as a flush writes (2 × ``--mib-per-rank``) in
  16 MiB writes to a new file, then fsync, into new
  files (as a flush writes), buffered and with O_DIRECT, and with O_DIRECT by two threads at
  once (as the two agents write); the ceiling is the fastest of the three. For comparison,
  rewriting a file deleted between runs;
* a 2-node × 1-rank job (``bench/jobs/state_job.py``: a fixed amount of matmul work per step,
  one thread, and a DTensor state of ``--mib-per-rank`` per rank), run twice: without a
  durable tier, and with ``--persist file://… --persist-every N``. From the second run's
  report every flush's window (start → commit) and size give the flush bandwidth; every
  step's wall-clock span says whether it ran while a flush did;
* the same job with persist and the ranks idle (1 s steps of sleep): the flush bandwidth when
  the low-priority writers get a core.

Results: ``bench/results/flush.json``; keys ``step_s_without_persist``,
``step_s_during_flush``, ``step_s_with_persist_idle``, ``flush_slowdown`` (during flush /
without persist − 1), ``flush_gbps``, ``disk_write_gbps``, ``flush_vs_disk``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    disk_write_direct_gbps,
    disk_write_direct_parallel_gbps,
    disk_write_gbps,
    run_peerckpt,
    scratch_dir,
    write_result,
)

JOB = Path(__file__).resolve().parent / "jobs" / "state_job.py"


def disk_ceilings(directory: Path, runs: int, nbytes: int) -> dict[str, Any]:
    """The disk's write bandwidth two ways: into new files kept until the end (fresh blocks,
    as a flush writes a new step), and rewriting one file deleted between runs (blocks the
    filesystem just freed). Some virtual disks differ by 5x between the two."""
    fresh = [disk_write_gbps(directory / f"fresh-{i}.bin", nbytes) for i in range(runs)]
    for i in range(runs):
        (directory / f"fresh-{i}.bin").unlink()
    reused = []
    for _ in range(runs):
        reused.append(disk_write_gbps(directory / "reused.bin", nbytes))
        (directory / "reused.bin").unlink()
    # The flush writes local files with O_DIRECT (persist/durable.py); the same, here, is the
    # device's own bandwidth, and the ceiling is the faster of the two ways.
    direct = []
    for i in range(runs):
        direct.append(disk_write_direct_gbps(directory / f"direct-{i}.bin", nbytes))
        (directory / f"direct-{i}.bin").unlink()
    # Two writers at once, as the flush's two agents write: the disk does more at a deeper
    # queue (measured: 1.6 GB/s one writer, 2.2 GB/s the two agents' idle flush).
    parallel = []
    for i in range(runs):
        pair = [directory / f"pair-{i}-{w}.bin" for w in (0, 1)]
        parallel.append(disk_write_direct_parallel_gbps(pair, nbytes))
        for path in pair:
            path.unlink()
    best = max(statistics.median(fresh), statistics.median(direct), statistics.median(parallel))
    return {
        "disk_write_gbps": best,
        "disk_write_direct_parallel_gbps": statistics.median(parallel),
        "disk_write_direct_parallel_gbps_runs": parallel,
        "disk_write_buffered_gbps": statistics.median(fresh),
        "disk_write_buffered_gbps_runs": fresh,
        "disk_write_direct_gbps": statistics.median(direct),
        "disk_write_direct_gbps_runs": direct,
        "disk_rewrite_gbps": statistics.median(reused),
        "disk_rewrite_gbps_runs": reused,
    }


def run_job(
    args: argparse.Namespace,
    out: Path,
    persist: str | None,
    work: int,
    sleep: float,
    steps: int | None = None,
) -> dict[str, Any]:
    out.mkdir(parents=True)
    argv = [
        "--nodes",
        "2",
        "--nproc-per-node",
        "1",
        "--job",
        f"benchflush{os.getpid()}_{'p' if persist else 'n'}{len(list(out.parent.iterdir()))}",
        "--report",
        str(out / "report.json"),
    ]
    if persist:
        argv += ["--persist", persist, "--persist-every", str(args.every)]
    argv += [
        str(JOB),
        str(out),
        "--world",
        "2",
        "--mib-per-rank",
        str(args.mib_per_rank),
        "--steps",
        str(steps or args.steps),
        "--sleep",
        str(sleep),
        "--work",
        str(work),
    ]
    run_peerckpt(argv)
    timings = [
        json.loads(line)
        for rank in (0, 1)
        for line in (out / f"steps-rank{rank}.jsonl").read_text().splitlines()
    ]
    report = json.loads((out / "report.json").read_text())
    return {"steps": timings, "flushes": report.get("flushes", [])}


def analyse(args: argparse.Namespace, plain: dict[str, Any], persisted: dict[str, Any]) -> dict:
    skip = 5  # warm-up steps: first allocations and the first snapshots
    base = [s["t1"] - s["t0"] for s in plain["steps"] if s["step"] >= skip]
    windows = [
        (f["started_at"], f["committed_at"])
        for f in persisted["flushes"]
        if f["state"] == "committed"
    ]
    during: list[float] = []
    idle: list[float] = []
    for s in persisted["steps"]:
        if s["step"] < skip:
            continue
        busy = any(s["t0"] < end and s["t1"] > start for start, end in windows)
        (during if busy else idle).append(s["t1"] - s["t0"])
    committed = [f for f in persisted["flushes"] if f["state"] == "committed"]
    rates = [f["nbytes"] / (f["committed_at"] - f["started_at"]) / 1e9 for f in committed]
    # Where a flush's window goes: the slowest writer (its agent's own timer, from the flush
    # event to its part written), and the rest (event delivery, merging the parts into the
    # manifest, marker, `latest`).
    writers = [max(f["writers"].values()) for f in committed if f.get("writers")]
    return {
        "writer_s": statistics.median(writers) if writers else None,
        "window_s": statistics.median(f["committed_at"] - f["started_at"] for f in committed)
        if committed
        else None,
        "step_s_without_persist": statistics.median(base),
        "step_s_during_flush": statistics.median(during) if during else None,
        "step_s_with_persist_idle": statistics.median(idle) if idle else None,
        "steps_during_flush": len(during),
        "flushes_committed": len(committed),
        "flushes_failed": len([f for f in persisted["flushes"] if f["state"] == "failed"]),
        "flush_bytes": committed[0]["nbytes"] if committed else 0,
        "flush_gbps_runs": rates,
        "flush_gbps": statistics.median(rates) if rates else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib-per-rank", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="flush every N steps")
    parser.add_argument("--work", type=int, default=60, help="matmuls per step")
    parser.add_argument("--runs", type=int, default=3, help="disk ceiling repetitions")
    parser.add_argument("--tensors", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    with scratch_dir("flush") as scratch:
        base = Path(scratch)
        # As many bytes as one flush writes: this virtual disk absorbs a burst faster than
        # a long write (1 GiB: 1.6 GB/s with O_DIRECT; the 512 MiB flush idle: 2.8 GB/s).
        ceilings = disk_ceilings(base, args.runs, 2 * args.mib_per_rank << 20)
        disk = ceilings["disk_write_gbps"]
        print(
            f"disk write, new files: {ceilings['disk_write_buffered_gbps']:.2f} GB/s buffered + "
            f"fsync, {ceilings['disk_write_direct_gbps']:.2f} GB/s O_DIRECT, "
            f"{ceilings['disk_write_direct_parallel_gbps']:.2f} GB/s by two O_DIRECT writers; "
            "rewriting freed "
            f"blocks: {ceilings['disk_rewrite_gbps']:.2f} GB/s; ceiling {disk:.2f} GB/s"
        )
        plain = run_job(args, base / "plain", None, args.work, 0.0)
        persisted = run_job(args, base / "persist", f"file://{base}/ckpt", args.work, 0.0)
        # The same flushes with the ranks idle (1 s steps of sleep, so that the per-step
        # snapshot and replication of the state leave the cores free most of the time): what
        # the writers do when they get a core, as on a GPU node whose CPUs are mostly free.
        idle = run_job(args, base / "idle", f"file://{base}/ckpt-idle", 0, 1.0, steps=31)
    result = analyse(args, plain, persisted)
    idle_rates = [
        f["nbytes"] / (f["committed_at"] - f["started_at"]) / 1e9
        for f in idle["flushes"]
        if f["state"] == "committed"
    ]
    result["flush_gbps_idle_runs"] = idle_rates
    result["flush_gbps_idle"] = statistics.median(idle_rates) if idle_rates else None
    result.update(
        **ceilings,
        state_bytes=2 * args.mib_per_rank << 20,
        every=args.every,
        steps=args.steps,
    )
    base_s, during = result["step_s_without_persist"], result["step_s_during_flush"]
    result["flush_slowdown"] = during / base_s - 1 if during else None
    result["flush_vs_disk"] = result["flush_gbps"] / disk if result["flush_gbps"] else None
    idle_gbps = result["flush_gbps_idle"]
    result["flush_idle_vs_disk"] = idle_gbps / disk if idle_gbps else None
    path = write_result("flush", result)
    print(f"step time without persist        {base_s * 1000:8.1f} ms")
    if during:
        print(
            f"step time while a flush runs     {during * 1000:8.1f} ms  "
            f"({result['flush_slowdown']:+.1%}, {result['steps_during_flush']} steps)"
        )
    if result["step_s_with_persist_idle"]:
        print(
            f"step time with persist, idle     {result['step_s_with_persist_idle'] * 1000:8.1f} ms"
        )
    if result["flush_gbps"]:
        print(
            f"flush {result['flush_bytes'] / 2**20:.0f} MiB: {result['flush_gbps']:.2f} GB/s, "
            f"{result['flush_vs_disk']:.0%} of the disk's {disk:.2f} GB/s "
            f"({result['flushes_committed']} flushes, {result['flushes_failed']} failed)"
        )
    if result["writer_s"]:
        print(
            f"a flush's window {result['window_s'] * 1000:.0f} ms, its slowest writer "
            f"{result['writer_s'] * 1000:.0f} ms (median)"
        )
    if idle_gbps:
        print(
            f"flush with the ranks idle: {idle_gbps:.2f} GB/s, "
            f"{result['flush_idle_vs_disk']:.0%} of the disk"
        )
    print(f"written {path}")


if __name__ == "__main__":
    main()
