"""What a script's top level costs a recovery by a spare (decision 25).

    python bench/toplevel.py [--runs 2] [--quick]   (not part of make bench)

A spare waits for its rank at ``import peerckpt`` and runs the script's top level only once it
has one, as that rank (``runtime/standby.py``): the script reads its rank there, as nanoGPT's
``train.py`` does. What the top level does after the import (a dataset built, arguments
parsed) therefore counts in the recovery. Each run is ``peerckpt run --nodes 2
--nproc-per-node 2 --spares 1 --chaos 'kill rank=1 at=10'`` on ``tests/jobs/nanogpt_job.py``
with ``--top-s T``: its top level sleeps T seconds after the import, standing for that work.
Per T: kill → every rank stepping again (the report's figure), and its excess over T = 0. The
expected cost is T itself; anything more would be the standby's.

Writes ``bench/results/toplevel.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from common import (
    REPO,
    background_load,
    bench_parser,
    job_name,
    run_peerckpt,
    scratch_dir,
    write_result,
)

sys.path.insert(0, str(REPO))
from peerckpt.launch.report import settled_at
from peerckpt.messages.control import RecoveryEvent

JOB = REPO / "tests" / "jobs" / "nanogpt_job.py"


def one_run(out: Path, top_s: float) -> float | None:
    """Seconds from the kill to every rank stepping again, or None if they never did."""
    out.mkdir()
    shape = ["--nodes", "2", "--nproc-per-node", "2", "--spares", "1", "--job", job_name("top")]
    chaos = ["--chaos", "kill rank=1 at=10", "--report", str(out / "report.json")]
    script = [str(JOB), str(out), "--steps", "20", "--top-s", str(top_s)]
    run_peerckpt([*shape, *chaos, *script])
    report = json.loads((out / "report.json").read_text())
    [kill] = report["chaos"]
    settled = settled_at([RecoveryEvent.from_json(e) for e in report["events"]], 0)
    return round(settled - kill["fired_at"], 3) if settled else None


def main() -> None:
    parser = bench_parser(__doc__)
    parser.set_defaults(runs=2)
    args = parser.parse_args()
    load = background_load()
    runs = 1 if args.quick else args.runs
    tops = (0.0, 1.0, 3.0)
    measured: dict[str, list[float | None]] = {}
    with scratch_dir("toplevel") as out:
        for top in tops:
            measured[str(top)] = [one_run(Path(out) / f"top{top}-run{i}", top) for i in range(runs)]
            print(f"top level {top:g} s: kill → stepping again {measured[str(top)]}", flush=True)
    medians: dict[str, float | None] = {
        t: round(statistics.median(v), 3) if all(x is not None for x in v) else None  # type: ignore[type-var, arg-type]
        for t, v in measured.items()
    }
    base = medians["0.0"]
    rows: list[dict[str, Any]] = [
        {
            "top_level_s": float(t),
            "kill_to_stepping_s": m,
            "excess_s": round(m - base, 3) if m is not None and base is not None else None,
            "runs": measured[t],
        }
        for t, m in medians.items()
    ]
    for row in rows:
        print(
            f"top level {row['top_level_s']:g} s: median {row['kill_to_stepping_s']} s, "
            f"{row['excess_s']} s more than with none"
        )
    write_result(
        "toplevel",
        {
            "quick": args.quick,
            "job": "2 nodes × 2 ranks, tests/jobs/nanogpt_job.py, spares 1, kill rank=1 at=10",
            "load": load,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
