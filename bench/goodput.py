"""Goodput under repeated failures: the effective training time ratio (ETTR) of peerckpt, of
torchft and of a torchrun restart from DCP, on the same job, state size and fault schedule.

    python bench/goodput.py [--mib 64] [--minutes 3] [--fault-every 20] [--quick]
                            [--systems peerckpt,dcp,torchft] [--torchft-join-ms 10000]

Not part of ``make bench`` (its eight runs take about 40 minutes; ``make bench-goodput`` runs it).

The job: ``bench/jobs/cost_job.py`` (peerckpt), ``bench/jobs/goodput_torchft_job.py``
(torchft) and ``bench/jobs/goodput_dcp_job.py`` (plain torchrun + DCP) train the same MLP under DDP with fused AdamW, its parameters and both moments
``--mib`` MiB per rank, 4 ranks on 2 nodes of this machine, each step's batch seeded by the
step and the rank. First the plain loop (the DCP script saving nothing) measures a step; the
job then has as many steps as fill ``--minutes`` of plain training. Each system runs them
twice, fault-free and under a fault every ``--fault-every`` seconds of wall clock from its
first step:

* **peerckpt** (``peerckpt run`` as a ``LocalLauncher``: one buddy per rank, 2 spares on a
  spare node, spares replenished as they are used, as a cluster's hot-spare pool is): the
  faults alternate a rank's SIGKILL and a whole node's (its agent, its ranks, its memory),
  over every rank in turn. The script asks for ``resilient(mtbf=<fault interval>)``: the
  runtime's overhead budget and Young/Daly choose the snapshot interval.
* **peerckpt-every-step**: the same with ``resilient(every=1)``, the GPU path's setting
  (+0.3 % there): a fault re-does at most one step, so its ETTR is the recovery's cost alone,
  and its ``ettr_vs_plain`` shows what the snapshots themselves cost on this machine.
* **torchft** 0.2.0 (``bench/jobs/goodput_torchft_job.py`` under ``goodput_torchft.py``):
  ``torchft_lighthouse`` (min_replicas 1, as torchft's examples), 4 replica groups of one rank
  (the layout whose numerics are the 4-rank DDP job's: torchft's DDP all-reduces across
  replica groups only), each a ``Manager`` with ``ProcessGroupGloo`` and ``PGTransport``, and
  a supervisor that restarts a replica process when it dies; the restarted one heals from a
  live replica while the others step on with a smaller quorum. A replica process of each in
  turn is SIGKILLed (one replica group of four: milder than peerckpt's node kills).
* **DCP** (two torchrun "hosts", ``--max-restarts`` above the fault count): a worker of
  each host in turn is SIGKILLed; torchrun restarts every worker, which loads the latest
  checkpoint, saved every ``--ckpt-every`` steps (default 10; the JSON gives the save time
  and the Young/Daly interval it implies). A node's loss under torchrun is at least such a
  restart, so the schedule is the same number of faults.

``ettr``: the fault-free run's time over the faulty run's for the same steps, from the end of
step 12 (start-up and the overhead budget's calibration excluded) to the end of the last step;
peerckpt's faulty run must end with the fault-free run's model and optimizer digest (or the
target is not met); DCP's ``bit_exact`` is recorded (a restarted DDP's first buckets change
gloo's summation order, which peerckpt's snapshots carry and a DCP restart does not).
torchft's steps are its manager's committed steps (the quorum's count, the same number of
steps as the others); they are not the same work, since a step under a smaller quorum
averages fewer batches: ``ettr_batches`` counts the batches trained instead, and
``bit_exact`` is false by design (see the JSON's ``torchft.reason``). ``peerckpt_vs_torchft``
compares the two ETTRs of one run. ``ettr_vs_plain`` is the usual ETTR, productive time over
wall time: the plain loop's time for the window's steps over the faulty run's, so that what
the snapshots or saves cost counts as lost as well. Results: ``bench/results/goodput.json`` (a ``--systems``
subset: ``goodput-<systems>.json``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goodput_torchft
from common import (
    HEARTBEAT_TIMEOUT_S,
    REPO,
    background_load,
    bench_parser,
    job_name,
    leftover_segments,
    scratch_dir,
    target,
    write_result,
)

sys.path.insert(0, str(REPO))
from peerckpt.launch.base import JobOutcome, JobSpec
from peerckpt.launch.local import LocalLauncher
from tests.torchrun_hosts import TorchrunJob, runtime_dirs

JOBS = REPO / "bench" / "jobs"
WORLD = 4
WARMUP = 12  # the window starts at this step's end: start-up and calibration are left out
GOAL = 0.97


def _rows(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(out.glob("steps-rank*.jsonl")):
        rows += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return rows


def window_s(out: Path, steps: int) -> float:
    """From the end of step WARMUP in the first epoch to the end of the last step."""
    rows = _rows(out)
    first = min(r["epoch"] for r in rows)
    start = max(r["t1"] for r in rows if r["epoch"] == first and r["step"] == WARMUP)
    end = max(r["t1"] for r in rows if r["step"] == steps - 1)
    return end - start


def _digest(out: Path) -> str:
    [*_, last] = sorted(out.glob("final-e*.json"), key=lambda p: int(p.stem.split("-e")[1]))
    return str(json.loads(last.read_text())["digest"])


def _stepping_since(out: Path, since: float) -> int:
    """How many ranks completed a step that began after ``since``."""
    count = 0
    for path in out.glob("steps-rank*.jsonl"):
        lines = path.read_text().splitlines()
        try:
            count += bool(lines) and json.loads(lines[-1])["t0"] > since
        except ValueError:
            pass  # a line being written
    return count


def _first_step_at(out: Path, timeout: float = 300.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = _rows(out)
        if rows:
            return min(r["t0"] for r in rows)
        time.sleep(0.05)
    raise SystemExit(f"no step was recorded in {out} within {timeout:g} s")


# -- peerckpt -----------------------------------------------------------------------------
def peerckpt_chaos(faults: int, every_s: float) -> str:
    """Faults every ``every_s`` seconds from the first epoch: a rank, then a node, in turn."""
    clauses = []
    for k in range(faults):
        rank, after = k % WORLD, every_s * (k + 1)
        what = f"rank={rank}" if k % 2 == 0 else f"node=@{rank}"
        clauses.append(f"kill {what} at=0 after={after:g}")
    return "; ".join(clauses)


def peerckpt_run(
    base: Path, mib: int, steps: int, mtbf: float, chaos: str, every: int | None = None
) -> dict[str, Any]:
    """One peerckpt job: ``resilient(mtbf=…)`` choosing its interval, or ``every`` fixed."""
    tag = "faults" if chaos else "clean"
    out = base / (f"peerckpt-{tag}" if every is None else f"peerckpt-every{every}-{tag}")
    out.mkdir()
    name = job_name("benchgood")
    args = [str(out), "--mib", str(mib), "--steps", str(steps), "--mtbf", f"{mtbf:g}"]
    if every is not None:
        args += ["--every", str(every)]
    spec = JobSpec(
        script=str(JOBS / "cost_job.py"),
        args=args,
        nodes=2,
        nproc_per_node=2,
        spares=2,
        replicas=1,
        heartbeat_timeout=float(HEARTBEAT_TIMEOUT_S),
        chaos=chaos,
        keep_spares=True,
        job=name,
    )
    launcher = LocalLauncher(spec)
    try:
        result = launcher.run()
    finally:
        left = leftover_segments(name)
    if result.state is not JobOutcome.SUCCEEDED:
        raise SystemExit(f"the peerckpt job {result.state.value}: {result.reason}")
    fired = [c for c in result.chaos if c.fired_at]
    row: dict[str, Any] = {
        "window_s": window_s(out, steps),
        "digest": _digest(out),
        "faults_fired": len(fired),
        "recoveries": len(result.events),
        "leftover_segments": left,
    }
    chosen = [json.loads(x) for x in (out / "policy.jsonl").read_text().splitlines() if x]
    row["every"] = sorted({c["every"] for c in chosen if c["every"] is not None})
    # what one rank measured and chose, and the interval every rank agreed on
    row["interval"] = next(
        (dict(c["interval"], agreed_every=c["every"]) for c in chosen if c["interval"]), None
    )
    if fired:
        row["restored_steps"] = [e.restore_step for e in result.events]
        row["recovery_kinds"] = [e.kind.value for e in result.events]
    return row


# -- DCP under torchrun -------------------------------------------------------------------
def dcp_run(
    base: Path, mib: int, steps: int, ckpt_every: int, faults: int, every_s: float, tag: str
) -> dict[str, Any]:
    out = base / f"dcp-{tag}"
    args = [str(out), "--mib", str(mib), "--steps", str(steps)]
    if ckpt_every:
        args += ["--ckpt", str(out / "ckpt"), "--ckpt-every", str(ckpt_every)]
    name = job_name("benchgdcp")
    job = TorchrunJob(
        out, name, JOBS / "goodput_dcp_job.py", args, nnodes="2", nproc=2, max_restarts=faults + 3
    )
    killed: list[float] = []
    try:
        started = _first_step_at(out)
        deadline = time.monotonic() + 3600
        while any(p.poll() is None for p in job.procs):
            if time.monotonic() > deadline:
                raise SystemExit(f"DCP {tag}: the job did not end within an hour")
            due = started + every_s * (len(killed) + 1)
            # Only while every rank steps: a kill while torchrun restarts the workers would
            # strike a process that has not joined yet (and end the attempt's arrivals count,
            # ``torchrun_job.init_fresh_group``, out of step).
            stepping = _stepping_since(out, killed[-1] if killed else 0.0) == WORLD
            if len(killed) < faults and time.time() >= due and stepping:
                try:
                    job.kill_worker(len(killed) % 2)
                    killed.append(time.time())
                except (ValueError, OSError):
                    pass  # torchrun is between restarts: try again in a moment
            time.sleep(0.05)
        codes = job.wait(60)
    finally:
        job.stop()
    if codes != [0, 0]:
        raise SystemExit(f"DCP {tag}: torchrun exited {codes}:\n{job.log()[-3000:]}")
    saves = []
    for path in out.glob("saves-rank*.jsonl"):
        saves += [json.loads(x)["s"] for x in path.read_text().splitlines() if x.strip()]
    rows = _rows(out)
    plain = [r["t1"] - r["t0"] for r in rows if r["epoch"] == 0 and r["step"] >= WARMUP]
    return {
        "window_s": window_s(out, steps),
        "digest": _digest(out),
        "faults_fired": len(killed),
        "restarts": max(r["epoch"] for r in rows),
        "save_s": statistics.median(saves) if saves else None,
        "step_s": statistics.median(plain) if plain else None,
        "leftover": runtime_dirs(name),
    }


# -- torchft ----------------------------------------------------------------------------------
def torchft_run(
    base: Path, mib: int, steps: int, faults: int, every_s: float, tag: str, join_ms: int
) -> dict[str, Any]:
    """The torchft job (``goodput_torchft.py``: a lighthouse, 4 replica groups of one rank,
    a supervisor restarting the killed one) and what its rows say."""
    out = base / f"torchft-{tag}"
    args = ["--mib", str(mib), "--steps", str(steps)]
    row = goodput_torchft.run(out, args, faults, every_s, replicas=WORLD, join_timeout_ms=join_ms)
    kills = row.pop("kills")
    row.update(goodput_torchft.summarise(out, _rows(out), kills, steps, WARMUP, WORLD))
    row["window_s"] = window_s(out, steps)
    return row


SYSTEMS = ("peerckpt", "peerckpt-every-step", "dcp", "torchft")


def main() -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = bench_parser(__doc__)
    parser.add_argument("--mib", type=int, default=64, help="MiB of state per rank")
    parser.add_argument("--minutes", type=float, default=3.0, help="plain training per run")
    parser.add_argument("--fault-every", type=float, default=20.0, help="seconds")
    parser.add_argument("--ckpt-every", type=int, default=10, help="DCP: steps per save")
    parser.add_argument(
        "--torchft-join-ms",
        type=int,
        default=10000,
        help="torchft_lighthouse --join_timeout_ms (torchft's README and examples: 10000)",
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated, of {', '.join(SYSTEMS)} (default all; a subset writes "
        "goodput-<systems>.json)",
    )
    args = parser.parse_args()
    chosen = [x.strip() for x in args.systems.split(",") if x.strip()]
    if not chosen or set(chosen) - set(SYSTEMS):
        parser.error(f"--systems {args.systems!r}: name one or more of {', '.join(SYSTEMS)}")
    minutes, every_s = (0.5, 10.0) if args.quick else (args.minutes, args.fault_every)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("PEERCKPT_LOG_LEVEL", "WARNING")
    load = background_load()
    print(f"background load before starting: {load}", flush=True)
    result: dict[str, Any] = {
        "quick": args.quick,
        "systems": chosen,
        "mib_per_rank": args.mib,
        "world": "2 nodes × 2 ranks",
        "fault_every_s": every_s,
        "ckpt_every": args.ckpt_every,
    }
    with scratch_dir("goodput") as scratch:
        base = Path(scratch)
        probe = dcp_run(base, args.mib, WARMUP + 30, 0, 0, every_s, "plain")
        step_s = probe["step_s"]
        steps = WARMUP + 1 + math.ceil(minutes * 60 / step_s)
        faults = int(minutes * 60 // every_s)
        print(f"plain step {step_s:.3f} s: {steps} steps, {faults} faults", flush=True)
        result.update(plain_step_s=step_s, steps=steps, faults=faults)
        systems: dict[str, dict[str, Any]] = {}
        if "peerckpt" in chosen:
            clean = peerckpt_run(base, args.mib, steps, every_s, "")
            print(f"  peerckpt, no faults: {clean}", flush=True)
            faulty = peerckpt_run(base, args.mib, steps, every_s, peerckpt_chaos(faults, every_s))
            print(f"  peerckpt, faults: {faulty}", flush=True)
            systems["peerckpt"] = {"clean": clean, "faults": faulty}
        if "peerckpt-every-step" in chosen:
            # the GPU path's setting (a snapshot after every step, +0.3 % there): the figure
            # of recovery alone, each fault re-doing at most one step
            clean = peerckpt_run(base, args.mib, steps, every_s, "", every=1)
            print(f"  peerckpt every step, no faults: {clean}", flush=True)
            faulty = peerckpt_run(
                base, args.mib, steps, every_s, peerckpt_chaos(faults, every_s), every=1
            )
            print(f"  peerckpt every step, faults: {faulty}", flush=True)
            systems["peerckpt-every-step"] = {"clean": clean, "faults": faulty}
        if "dcp" in chosen:
            clean = dcp_run(base, args.mib, steps, args.ckpt_every, 0, every_s, "clean")
            print(f"  DCP, no faults: {clean}", flush=True)
            faulty = dcp_run(base, args.mib, steps, args.ckpt_every, faults, every_s, "faults")
            print(f"  DCP, faults: {faulty}", flush=True)
            systems["dcp"] = {"clean": clean, "faults": faulty}
        if "torchft" in chosen:
            clean = torchft_run(base, args.mib, steps, 0, every_s, "clean", args.torchft_join_ms)
            print(f"  torchft, no faults: {clean}", flush=True)
            faulty = torchft_run(
                base, args.mib, steps, faults, every_s, "faults", args.torchft_join_ms
            )
            print(f"  torchft, faults: {faulty}", flush=True)
            systems["torchft"] = {"clean": clean, "faults": faulty}
    for name, runs in systems.items():
        clean, faulty = runs["clean"], runs["faults"]
        runs["ettr"] = clean["window_s"] / faulty["window_s"]
        runs["lost_per_fault_s"] = (faulty["window_s"] - clean["window_s"]) / max(
            1, faulty["faults_fired"]
        )
        runs["bit_exact"] = clean["digest"] == faulty["digest"]
        # the usual ETTR (productive time over wall time): the plain loop's time for the
        # window's steps over the faulty run's, so the snapshots' own cost counts as lost too
        runs["ettr_vs_plain"] = step_s * (steps - 1 - WARMUP) / faulty["window_s"]
        result[name] = runs
        result[f"ettr_{name}"] = runs["ettr"]
    if "dcp" in systems:
        dcp = systems["dcp"]
        save_s = dcp["clean"].get("save_s")
        if save_s:
            dcp["young_daly_every"] = round(math.sqrt(2 * save_s * every_s) / step_s)
    if "torchft" in systems:
        goodput_torchft.notes(systems["torchft"], every_s, WARMUP)
    result["targets"] = {
        f"ettr_{name.replace('-', '_')}": _peerckpt_target(systems, name, every_s)
        for name in ("peerckpt", "peerckpt-every-step")
        if name in systems
    }
    if {"peerckpt", "torchft"} <= systems.keys():
        peer, ft = systems["peerckpt"], systems["torchft"]
        # in one run, each against its own fault-free run: the ETTRs compare, the windows not
        result["peerckpt_vs_torchft"] = {
            "ettr_ratio": peer["ettr"] / ft["ettr"],
            "lost_per_fault_s": {
                "peerckpt": peer["lost_per_fault_s"],
                "torchft": ft["lost_per_fault_s"],
            },
        }
    name = "goodput" if set(chosen) == set(SYSTEMS) else "goodput-" + "-".join(chosen)
    path = write_result(name, result)
    figures = ", ".join(f"{n} {r['ettr']:.3f}" for n, r in systems.items())
    print(
        f"ETTR over {steps} steps with a fault every {every_s:g} s: {figures} "
        f"(goal for peerckpt ≥ {GOAL}); written {path}"
    )


def _peerckpt_target(
    systems: dict[str, dict[str, Any]], name: str, every_s: float
) -> dict[str, Any]:
    """peerckpt's ETTR (``name``: its interval chosen, or every step) against the goal, with
    the measured cause where it is missed."""
    peer = systems[name]
    row = target(peer["ettr"], GOAL, "higher")
    others = ", ".join(f"{n} {systems[n]['ettr']:.2f}" for n in ("torchft", "dcp") if n in systems)
    if others:
        row["beside"] = f"in the same run: {others}"
    if peer["ettr"] < GOAL:
        interval = peer["faults"].get("interval") or peer["clean"].get("interval") or {}
        why = ""
        if interval:
            # The best any snapshot interval can do against this fault rate (Young/Daly: the
            # snapshots' overhead plus the re-done work, at the optimum), recovery not counted.
            bound = 1 - math.sqrt(2 * interval["snapshot_cost_s"] / every_s)
            peer["young_daly_ettr_bound"] = bound
            why = (
                f"; the overhead budget chose a snapshot every {interval['agreed_every']} steps "
                f"(a snapshot costs {interval['snapshot_cost_s']:.2f} s against a "
                f"{interval['step_s']:.2f} s step here; Young/Daly for MTBF {every_s:g} s: "
                f"every {interval['young_daly_every']}), so a fault re-does "
                f"{interval['expected_lost_s']:.1f} s of steps on average; with such a "
                f"snapshot cost no interval gets above {bound:.2f} (1 − sqrt(2·C/MTBF))"
            )
        else:
            why = (
                "; a snapshot after every step, so a fault re-does at most one step, and both "
                "runs pay the snapshots' cost (against the plain loop the ETTR is "
                f"{peer['ettr_vs_plain']:.2f})"
            )
        row["reason"] = (
            f"{peer['faults']['faults_fired']} faults cost {peer['lost_per_fault_s']:.2f} s "
            f"each against {every_s:g} s between them{why} (see docs/performance.md, "
            "“Goodput under failures”)"
        )
    if not peer["bit_exact"]:
        row["met"] = False
        row["reason"] = "the faulty run did not end bit-exact"
    return row


if __name__ == "__main__":
    main()
