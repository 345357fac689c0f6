"""The time a failure costs a training job: kill → first step completed after the restart,
less one normal step (``bench/recovery.py`` runs it; alone: ``python bench/cost.py``).

    python bench/cost.py [--mib 256] [--runs 3]

The job is ``bench/jobs/cost_job.py``: an ordinary DDP script (MLP, fused AdamW, parameters
and both moments about ``--mib`` MiB per rank) on 4 ranks (2 nodes × 2, one spare, one buddy
each), a snapshot every step; ``--chaos 'kill rank=2 at=K'`` SIGKILLs a rank while step K
runs. From the ranks' step spans and the job's report:

* ``cost_s``: from the kill to the moment every rank has completed its first step of the new
  epoch, less one normal step (the median step of the first epoch after its warm-up);
* the breakdown: ``detection`` (kill → the coordinator knows), ``rejoin`` (→ the last rank
  entered the function again: decision, abort, data, the new process group), ``track`` (→ the
  last rank's ``ctx.track`` returned: building the model, DDP, the restore), ``first_step``
  (→ every rank completed its first step);
* ``first_step_s`` of survivors and of the replacement against ``step_s`` (a normal step).
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HEARTBEAT_TIMEOUT_S, job_name, leftover_segments, run_peerckpt

from peerckpt.runtime.policy import DECIDE_AT

JOBS = Path(__file__).resolve().parent / "jobs"
# from this step on the job snapshots every n steps (a calibration's steps snapshot more often)
DECIDED = DECIDE_AT


def _steps(out: Path, world: int) -> dict[int, list[dict[str, Any]]]:
    return {
        r: [json.loads(x) for x in (out / f"steps-rank{r}.jsonl").read_text().splitlines()]
        for r in range(world)
    }


def cost_run(
    mib: int,
    base: Path,
    kill: str = "at=10 after=2",
    steps: int = 22,
    extra: list[str] | None = None,
) -> dict[str, Any]:
    """One job with one rank killed; the figures of the module docstring."""
    world, victim = 4, 2
    out = base / f"cost-{mib}-{len(list(base.iterdir()))}"
    out.mkdir()
    job = job_name("benchcost")
    argv = ["--nodes", "2", "--nproc-per-node", "2", "--spares", "1", "--replicas", "1"]
    argv += ["--heartbeat-timeout", HEARTBEAT_TIMEOUT_S, "--job", job]
    argv += ["--chaos", f"kill rank={victim} {kill}", "--report", str(out / "report.json")]
    argv += [str(JOBS / "cost_job.py"), str(out), "--mib", str(mib), "--steps", str(steps)]
    try:
        proc = run_peerckpt(argv + (extra or []), log_level="INFO")
    finally:
        left = leftover_segments(job)
    report = json.loads((out / "report.json").read_text())
    [chaos] = report["chaos"]
    [event] = [e for e in report["events"] if e["kind"] == "rank"]
    fired, detected = chaos["fired_at"], event["detected_at"]
    restored = [json.loads(x) for x in (out / "restored.jsonl").read_text().splitlines()]
    epoch = event["epoch"]
    spans = _steps(out, world)
    # A normal step: from one step's end to the next's, once the interval is chosen (the
    # calibration's steps snapshot every step), in either epoch.
    normal = statistics.median(
        b["t1"] - a["t1"]
        for rows in spans.values()
        for a, b in itertools.pairwise(rows)
        if a["epoch"] == b["epoch"] and a["step"] >= DECIDED
    )
    first = {r: next(x for x in rows if x["epoch"] == epoch) for r, rows in spans.items()}
    done = max(x["t1"] for x in first.values())
    entered = max(x["entered_at"] for x in restored if x["epoch"] == epoch)
    tracked = max(x["tracked_at"] for x in restored if x["epoch"] == epoch)
    first_s = {r: x["t1"] - x["t0"] for r, x in first.items()}
    [pull] = [p for p in event["pulls"] if p["rank"] == victim]
    every = re.findall(r"snapshot every (\d+) step\(s\)", proc.stdout + proc.stderr)
    return {
        "every": int(every[0]) if every else None,
        "cost_s": done - fired - normal,
        "kill_to_first_step_s": done - fired,
        "step_s": normal,
        "breakdown": {
            "detection_s": detected - fired,
            "rejoin_s": entered - detected,
            "track_s": tracked - entered,
            "first_step_s": done - tracked,
        },
        "first_step_s": {
            "survivors": max(v for r, v in first_s.items() if r != victim),
            "replacement": first_s[victim],
        },
        "restore_step": event["restore_step"],
        "transfer_s": pull["seconds"],
        "transfer_bytes": pull["bytes"],
        "final_digest": json.loads((out / f"final-e{epoch}.json").read_text())["digest"],
        "leftover_segments": left,
    }


def measure(mib: int, runs: int, base: Path) -> dict[str, Any]:
    """``runs`` jobs; the median cost, its breakdown and every run."""
    rows = []
    for i in range(runs):
        row = cost_run(mib, base)
        rows.append(row)
        print(
            f"  failure cost run {i}: {row['cost_s']:.2f} s (kill → first step "
            f"{row['kill_to_first_step_s']:.2f} s, step {row['step_s']:.2f} s, n = "
            f"{row['every']}; { {k: round(v, 2) for k, v in row['breakdown'].items()} })",
            flush=True,
        )
    digests = {r.pop("final_digest") for r in rows}

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "cost_s": median("cost_s"),
        "kill_to_first_step_s": median("kill_to_first_step_s"),
        "step_s": median("step_s"),
        "breakdown": {
            k: statistics.median(r["breakdown"][k] for r in rows) for k in rows[0]["breakdown"]
        },
        "first_step_s": {
            k: statistics.median(r["first_step_s"][k] for r in rows)
            for k in ("survivors", "replacement")
        },
        "transfer_gbps": statistics.median(
            r["transfer_bytes"] / r["transfer_s"] / 1e9 for r in rows
        ),
        "every": [r["every"] for r in rows],
        "same_final_digest_every_run": len(digests) == 1,
        "runs": rows,
    }


def reason(row: dict[str, Any], torchft_s: float | None) -> str:
    """Where the time a failure costs goes, from the runs' medians."""
    b = row["breakdown"]
    parts = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.2f} s" for k, v in b.items())
    first = row["first_step_s"]
    text = (
        f"{row['cost_s']:.2f} s: kill → every rank's first step done "
        f"{row['kill_to_first_step_s']:.2f} s ({parts}) less a normal step of "
        f"{row['step_s']:.2f} s. The first step after the restore took "
        f"{first['survivors']:.2f} s on the slowest survivor and {first['replacement']:.2f} s "
        f"on the replacement; the replacement's state came at {row['transfer_gbps']:.2f} GB/s"
    )
    if torchft_s:
        text += (
            f"; torchft's restarted process alone (spawn → state received, no detection, no "
            f"quorum, no step) took {torchft_s:.2f} s"
        )
    return text


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from common import scratch_dir

    with scratch_dir("cost") as scratch:
        row = measure(args.mib, args.runs, Path(scratch))
    row.pop("runs")
    print(json.dumps(row, indent=1), flush=True)


if __name__ == "__main__":
    main()
