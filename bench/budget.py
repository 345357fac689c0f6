"""The overhead budget kept: ``resilient(overhead=0.05)`` on the stall benchmark's loop
(``bench/stall.py`` runs it after its every-step figures).

One 2-node × 1-rank job (k = 1) of ``bench/jobs/train_job.py --overhead 0.05``: first
``PLAIN`` steps with nothing tracked (the baseline), then ``STEPS`` steps of ``ctx.steps``, of
which the first 9 measure what a snapshot costs and choose n (``runtime/policy.py``). The
figure is the mean step after the choice (every step from ``SKIP`` on, snapshot steps
included: a median would hide them) against the mean baseline step; the window is longer
than n wherever n ≤ ``STEPS`` − ``SKIP``, and the JSON says n.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from common import HEARTBEAT_TIMEOUT_S, job_name, leftover_segments, run_peerckpt

JOB = Path(__file__).resolve().parent / "jobs" / "train_job.py"
PLAIN, STEPS, SKIP = 6, 60, 11  # SKIP: the calibration's 9 steps, its last snapshot, one more


def budget_run(mib: int, batch: int, base: Path, overhead: float = 0.05) -> dict[str, Any]:
    """One job with the overhead budget; its stall against the baseline, and n."""
    out = base / f"budget-{mib}"
    out.mkdir(parents=True)
    job = job_name("benchbudget")
    argv = ["--nodes", "2", "--nproc-per-node", "1", "--job", job]
    argv += ["--heartbeat-timeout", HEARTBEAT_TIMEOUT_S, str(JOB), str(out)]
    argv += ["--mib", str(mib), "--batch", str(batch), "--overhead", str(overhead)]
    argv += ["--steps", str(STEPS), "--plain-steps", str(PLAIN)]
    try:
        proc = run_peerckpt(argv, log_level="INFO")
    finally:
        leftover_segments(job)
    ranks = [json.loads((out / f"steps-peerckpt-rank{r}.json").read_text()) for r in range(2)]
    plain = statistics.mean(t for r in ranks for t in r["plain_times"][2:])
    after = statistics.mean(t for r in ranks for t in r["times"][SKIP:])
    chosen = re.findall(r"snapshot every (\d+) step\(s\) \((\w[\w-]*)\): (.*?);", proc.stderr)
    every = re.findall(r"the ranks agreed on every (\d+) step", proc.stderr)
    return {
        "overhead": overhead,
        "every": int(every[0]) if every else None,
        "choices": [" ".join(c) for c in chosen],
        "step_s_plain": plain,
        "step_s_budget": after,
        "stall_fraction": after / plain - 1,
        "measured_steps": STEPS - SKIP,
    }
