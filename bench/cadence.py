"""The snapshot interval the overhead budget chooses, run after run.

The same job (``bench/jobs/cadence_job.py``: a small DDP model under the default
``@peerckpt.resilient()``, 2 nodes × 2 ranks) runs ``--runs`` times in a row on this machine
with a second job training beside it the whole time (``--alone``: without), as a shared
machine has; each run's interval is read from rank 0's log line (``runtime/policy.py``
logs the choice once). Target: the largest interval at most twice the smallest
(``interval_spread``), the cadence a user can expect of one job on one machine. Before the
calibration measured three snapshots and took the median over ranks, one unchanged job got
intervals of 1 to 91 steps here (issue 24).

Writes ``bench/results/cadence.json``.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import time

from common import (
    BENCH,
    HEARTBEAT_TIMEOUT_S,
    background_load,
    bench_parser,
    job_name,
    leftover_segments,
    run_peerckpt,
    scratch_dir,
    start_peerckpt,
    target,
    write_result,
)

JOB = BENCH / "jobs" / "cadence_job.py"
CHOICE = re.compile(
    r"snapshot every (\d+) step\(s\) \(([\w-]+)\): a snapshot costs (\d+) ms against a "
    r"(\d+) ms step"
)


def one_run(out: str, steps: int) -> dict[str, float | int | str]:
    job = job_name("cad")
    proc = run_peerckpt(
        [
            "--nodes",
            "2",
            "--nproc-per-node",
            "2",
            "--job",
            job,
            "--heartbeat-timeout",
            HEARTBEAT_TIMEOUT_S,
            str(JOB),
            out,
            "--steps",
            str(steps),
        ],
        log_level="INFO",
    )
    leftover_segments(job)
    found = CHOICE.findall(proc.stdout + proc.stderr)
    if len(found) != 1:
        raise SystemExit(f"expected one logged choice, found {len(found)}")
    every, rule, cost_ms, step_ms = found[0]
    return {"every": int(every), "rule": rule, "cost_ms": int(cost_ms), "step_ms": int(step_ms)}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=40, help="steps of each measured run")
    parser.add_argument("--alone", action="store_true", help="no second job beside it")
    parser.set_defaults(runs=10)
    args = parser.parse_args()
    load = background_load()
    runs = 2 if args.quick else args.runs
    beside: subprocess.Popen[str] | None = None
    beside_job = job_name("cadbeside")
    with scratch_dir("cadence") as out, scratch_dir("cadence-beside") as other:
        if not args.alone:
            beside = start_peerckpt(
                [
                    "--nodes",
                    "2",
                    "--nproc-per-node",
                    "2",
                    "--job",
                    beside_job,
                    "--heartbeat-timeout",
                    HEARTBEAT_TIMEOUT_S,
                    str(JOB),
                    other,
                    "--steps",
                    "1000000",
                ]
            )
            time.sleep(10.0)  # its processes are up and training
        try:
            results = []
            for i in range(runs):
                results.append(one_run(out, args.steps))
                print(f"run {i + 1}: {results[-1]}", flush=True)
        finally:
            if beside is not None:
                beside.terminate()  # its launcher stops and cleans up the job
                beside.communicate(timeout=120)
                leftover_segments(beside_job)
    intervals = [int(r["every"]) for r in results]
    spread = max(intervals) / min(intervals)
    result = {
        "quick": args.quick,
        "job": "2 nodes × 2 ranks, DDP MLP of ~1.4 MB state per rank, default budget (5 %)",
        "beside": None if args.alone else "the same job, training throughout",
        "runs": results,
        "intervals": intervals,
        "median_interval": statistics.median(intervals),
        "targets": {"interval_spread": target(round(spread, 2), 2.0, "at most", "×")},
        "background_load_before": load,
    }
    path = write_result("cadence", result)
    print(f"intervals {intervals}: largest / smallest {spread:.2f} → {path}")


if __name__ == "__main__":
    main()
