"""Across hosts: the same recovery as the local launcher's, with one ``peerckpt run`` per host.

    python bench/hosts.py [--mib 64] [--runs 2] [--quick]   (make bench: --runs 2)

The job is ``bench/jobs/state_job.py`` (frozen DTensors, the given MiB per rank, checked bit
for bit after every restore), 4 ranks, one buddy each, snapshotting every step. In one run
of this script, per run:

* **local** (``local_s``): ``peerckpt run --nodes 2 --nproc-per-node 2 --spares 2`` on this
  machine, ``--chaos 'kill rank=2 at=K'``;
* **hosts** (``hosts_s``): the same job as three ``peerckpt run`` processes, one per
  simulated host on its own loopback address (127.0.0.2, .3, .4: ``tests/hosts.py``): hosts
  0 and 1 hold the ranks, host 2 is a ``--spare-host``; host 1 runs the same chaos;
* **coordinator's host** (``moved_s``): the same three hosts, and host 0 — the coordinator,
  an agent, ranks 0 and 1 — SIGKILLed whole after K steps: host 1 takes the coordinator over
  (``peerckpt/succession.py``) and host 2's spares take ranks 0 and 1.

Timed from the kill to every rank stepping again (the coordinator's ``resumed_at``). The
``hosts`` / ``local`` ratio is what running across hosts adds (TLS is off on loopback in
both; on real hosts it is on). Results: ``bench/results/hosts.json``.
"""

from __future__ import annotations

import json
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
    run_peerckpt,
    scratch_dir,
    target,
    write_result,
)

sys.path.insert(0, str(REPO))
from tests.hosts import Hosts, await_step

JOB = REPO / "bench" / "jobs" / "state_job.py"
KILL_AT = 4
STEPS = 12


def _script_args(mib: int) -> list[str]:
    """The job's arguments after its output directory."""
    return [
        "--mib-per-rank",
        str(mib),
        "--world",
        "4",
        "--sleep",
        "0.05",
        "--steps",
        str(STEPS),
        "--after",
        "1",
    ]


def _timed(report: dict[str, Any], killed_at: float, kind: str) -> dict[str, Any]:
    """Kill → every rank stepping again, from a report's event of ``kind``."""
    events = [e for e in report["events"] if e["kind"] == kind]
    if not events:
        raise RuntimeError(f"no {kind} recovery in the report: {report.get('reason')}")
    event = events[-1]
    return {
        "stepping_again_s": event["resumed_at"] - killed_at,
        "detected_after_s": event["detected_at"] - killed_at,
        "pulled_bytes": sum(p["bytes"] for p in event["pulls"]),
    }


def local_run(mib: int, base: Path) -> dict[str, Any]:
    out = base / f"local-{time.monotonic_ns()}"
    out.mkdir()
    job = job_name("bhl")
    run_peerckpt(
        [
            "--nodes",
            "2",
            "--nproc-per-node",
            "2",
            "--spares",
            "2",
            "--heartbeat-timeout",
            HEARTBEAT_TIMEOUT_S,
            "--job",
            job,
            "--chaos",
            f"kill rank=2 at={KILL_AT}",
            "--report",
            str(out / "report.json"),
            str(JOB),
            str(out),
            *_script_args(mib),
        ]
    )
    report = json.loads((out / "report.json").read_text())
    [chaos] = report["chaos"]
    row = _timed(report, chaos["fired_at"], "rank")
    row["leftover"] = leftover_segments(job)
    return row


def _hosts(out: Path, mib: int) -> Hosts:
    env = {"PEERCKPT_LOG_LEVEL": "WARNING"}
    args = tuple(_script_args(mib))
    return Hosts(out, job_name("bhh"), script=JOB, script_args=args, env=env)


def _ended(hosts: Hosts, survivors: list[int], what: str) -> None:
    done = hosts.wait()
    hosts.forget_dead_machine()
    for rank in survivors:
        code, log = done[rank]
        if code != 0:
            raise RuntimeError(f"{what}: host {rank} exited {code}:\n{log[-3000:]}")


def hosts_run(mib: int, base: Path) -> dict[str, Any]:
    out = base / f"hosts-{time.monotonic_ns()}"
    hosts = _hosts(out, mib)
    hosts.start(0, "--heartbeat-timeout", HEARTBEAT_TIMEOUT_S)
    hosts.start(2, "--spare-host", "--heartbeat-timeout", HEARTBEAT_TIMEOUT_S)
    hosts.start(
        1, "--heartbeat-timeout", HEARTBEAT_TIMEOUT_S, "--chaos", f"kill rank=2 at={KILL_AT}"
    )
    _ended(hosts, [0, 1, 2], "hosts")
    [chaos] = hosts.report(1)["chaos"]
    row = _timed(hosts.report(0), chaos["fired_at"], "rank")
    row["leftover"] = leftover_segments(hosts.job)
    return row


def moved_run(mib: int, base: Path) -> dict[str, Any]:
    out = base / f"moved-{time.monotonic_ns()}"
    hosts = _hosts(out, mib)
    hosts.start(0, "--heartbeat-timeout", HEARTBEAT_TIMEOUT_S)
    hosts.start(2, "--spare-host", "--heartbeat-timeout", HEARTBEAT_TIMEOUT_S)
    hosts.start(1, "--heartbeat-timeout", HEARTBEAT_TIMEOUT_S)
    _await_steps(out, KILL_AT)
    killed_at = time.time()
    hosts.kill_host(0)
    _ended(hosts, [1, 2], "coordinator's host")
    row = _timed(hosts.report(1), killed_at, "node")
    row["leftover"] = leftover_segments(hosts.job)
    return row


def _await_steps(out: Path, steps: int) -> None:
    """Until every rank has recorded ``steps`` steps (state_job's per-rank progress)."""
    for rank in range(4):
        await_step(out / f"steps-rank{rank}.jsonl", steps)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--mib", type=int, default=64, help="MiB of state per rank")
    args = parser.parse_args()
    mib = 16 if args.quick else args.mib
    runs = 1 if args.quick else args.runs
    load = background_load()
    print(f"background load before starting: {load}", flush=True)
    rows: dict[str, list[dict[str, Any]]] = {"local": [], "hosts": [], "moved": []}
    with scratch_dir("hosts") as scratch:
        for _ in range(runs):
            for name, fn in (("local", local_run), ("hosts", hosts_run), ("moved", moved_run)):
                rows[name].append(fn(mib, Path(scratch)))
                print(f"  {name}: {rows[name][-1]}", flush=True)
    median = {k: statistics.median(r["stepping_again_s"] for r in v) for k, v in rows.items()}
    ratio = median["hosts"] / median["local"]
    result = {
        "quick": args.quick,
        "runs": runs,
        "mib_per_rank": mib,
        "world": "4 ranks: 2 hosts x 2, a spare host with 2 spares (local: 2 nodes, 2 spares)",
        "local_s": median["local"],
        "hosts_s": median["hosts"],
        "moved_s": median["moved"],
        "hosts_vs_local": ratio,
        "load": load,
        "targets": {
            "hosts_vs_local": {
                **target(ratio, 1.25, "lower"),
                "reason": "the same recovery; across hosts adds only each host's own launcher",
            },
            "moved_s": {
                **target(median["moved"], 10.0, "at most", " s"),
                "reason": (
                    "3 s of silence before host 1 takes the coordinator over, its start (a "
                    "Python process importing torch for the store), the agents' rejoin, then "
                    "the node recovery itself"
                ),
            },
        },
        "runs_detail": rows,
    }
    print(
        f"kill → every rank stepping again, {mib} MiB per rank: local {median['local']:.2f} s, "
        f"across hosts {median['hosts']:.2f} s ({ratio:.2f}x); the coordinator's host killed: "
        f"{median['moved']:.2f} s",
        flush=True,
    )
    print(f"wrote {write_result('hosts', result)}")


if __name__ == "__main__":
    main()
