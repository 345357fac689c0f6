"""The chaos campaign: ``peerckpt chaos --seed S --faults N script.py [args]``.

Runs the script twice as a local job of ``--nodes`` nodes: once without faults (the
reference), then under a seeded random sequence of faults, one every ``--every`` steps from
``--start``. The reference run says how many steps the script has: the faults are placed
inside them (spread evenly when ``--every`` is not given), and a request that cannot fit is
refused, with a value that fits, before the faulty run starts. The coordinator records the tensor digest of every snapshot of every rank and
step in both runs (``--record-digests``: the agents' crc32c of every chunk, folded), so the
comparison needs nothing from the script. Spares are replenished as they are used
(``keep_spares``), as a cluster's pool of hot spares would be.

For every fault it prints one row — the fault, the step it struck at, how long detection and
recovery took, the bytes pulled and from where, and whether every snapshot from there to the
next fault equals the reference bit for bit — writes the same as JSON, and exits non-zero if
a row is not bit-exact, a fault never fired, the job failed, or anything of the job is left
behind (a process, a shared-memory file, its socket directory).
"""

from __future__ import annotations

import glob
import json
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from peerckpt.chaos import FiredAction, check_ray_campaign, generate_ray, parse_chaos
from peerckpt.errors import ConfigurationError
from peerckpt.launch.base import JobOutcome, JobResult, JobSpec
from peerckpt.launch.local import LocalLauncher
from peerckpt.launch.progress import Report
from peerckpt.launch.report import FailureRow, causes, failure_rows
from peerckpt.launch.view import JobView
from peerckpt.messages.control import JobStatus, Pull
from peerckpt.outfiles import private_dir, write_private
from peerckpt.shm import SHM_DIR, segment_prefix

# Each entry: a weight, and the clause(s) of one fault for rank r at step s (one fault may be
# two clauses: a second kill timed inside the recovery of the first counts as two faults).
_FAULTS: list[tuple[str, int, str]] = [
    ("kill rank", 3, "kill rank={r} at={s}"),
    ("kill node", 2, "kill node=@{r} at={s}"),
    ("kill agent", 2, "kill agent node=@{r} at={s}"),
    ("hang", 2, "hang rank={r} at={s} for={hang}"),
    ("partition, long", 1, "partition node=@{r} at={s} for={hang}"),
    ("partition, short", 1, "partition node=@{r} at={s} for=0.3"),
    ("slow", 1, "slow node=@{r} at={s} rate=2 for=2"),
    ("corrupt", 1, "corrupt rank={r} at={s}"),
    ("kill coordinator", 1, "kill coordinator at={s}"),
    ("kill during snapshot", 2, "kill rank={r} at={s} during=snapshot"),
    ("kill during replication", 2, "kill node=@{r} at={s} during=replication"),
    ("kill during recovery", 2, "kill rank={r} at={s}; kill rank={r2} at={s} during=recovery"),
]


def generate(
    seed: int, faults: int, world: int, start: int, every: int, heartbeat_s: float
) -> list[str]:
    """A seeded sequence of ``faults`` fault clauses, one fault every ``every`` steps."""
    rng = random.Random(seed)
    names = [name for name, _, _ in _FAULTS]
    weights = [w for _, w, _ in _FAULTS]
    clauses: list[str] = []
    step = start
    while len(clauses) < faults:
        name = rng.choices(names, weights)[0]
        template = next(t for n, _, t in _FAULTS if n == name)
        if world < 2 and "{r2}" in template:
            continue
        r = rng.randrange(world)
        r2 = rng.choice([x for x in range(world) if x != r]) if world > 1 else r
        text = template.format(r=r, r2=r2, s=step, hang=round(heartbeat_s + 2.0, 1))
        parts = [p.strip() for p in text.split(";")]
        if len(clauses) + len(parts) > faults:
            continue
        clauses += parts
        step += every
    return clauses


# A fault fires while the ranks run its step; the last one strikes at most this many steps
# before the script's end, so that the recovery it causes trains steps the comparison sees.
TAIL_STEPS = 3
MIN_EVERY = 2


# A seeded sequence: (faults, start, every) → its clauses (``generate``, or on Ray
# ``raysched.generate_ray``).
Draw = Callable[[int, int, int], list[str]]


def place(
    seed: int,
    faults: int,
    world: int,
    start: int,
    every: int | None,
    heartbeat_s: float,
    steps: int,
    draw: Draw | None = None,
) -> list[str]:
    """The fault clauses of ``generate`` (or of ``draw``), placed inside a run of ``steps``
    steps: one every ``every`` steps from ``start``, or spread evenly up to the last step a
    fault can strike at when ``every`` is None. Raises ConfigurationError, naming a value
    that fits, when they cannot fit."""
    if draw is None:
        draw = lambda n, first, gap: generate(seed, n, world, first, gap, heartbeat_s)  # noqa: E731
    last = steps - TAIL_STEPS
    if start > last:
        raise ConfigurationError(
            f"--start {start} is past step {last}, the last a fault can strike at in the "
            f"fault-free run's {steps} steps; use --start {max(1, last)} or a longer script"
        )
    groups = _groups(draw, faults)
    if every is None:
        every = max(MIN_EVERY, (last - start) // (groups - 1)) if groups > 1 else MIN_EVERY
        how = f"spread over steps {start}…{last}"
    else:
        how = f"every {every} steps from step {start}"
    reach = start + every * (groups - 1)
    if reach <= last:
        return draw(faults, start, every)
    problem = (
        f"{faults} faults {how} would strike up to step {reach}, but the fault-free run has "
        f"{steps} steps and a fault must strike by step {last} to fire"
    )
    fits = (last - start) // (groups - 1) if groups > 1 else 0
    if fits >= MIN_EVERY:
        raise ConfigurationError(
            f"{problem}; use --every {fits} (or leave --every out to spread them evenly)"
        )
    fewer = next(
        (n for n in range(faults - 1, 0, -1) if start + MIN_EVERY * (_groups(draw, n) - 1) <= last),
        0,
    )
    need = start + MIN_EVERY * (groups - 1) + TAIL_STEPS
    fix = f"use --faults {fewer}, or " if fewer else ""
    raise ConfigurationError(
        f"{problem}, even {MIN_EVERY} steps apart; {fix}give the script at least {need} steps"
    )


def _groups(draw: Draw, faults: int) -> int:
    """How many distinct steps ``faults`` faults strike at (a kill timed inside a recovery
    shares its first kill's step). The sequence does not depend on the spacing, so one
    spaced by 1 tells."""
    return max(a.at for a in parse_chaos("; ".join(draw(faults, 0, 1)))) + 1


@dataclass
class Row:
    fault: str
    step: int | None  # the training step it struck in
    detected_s: float | None
    recovered_s: float | None
    pulled: str  # bytes pulled and from where
    bit_exact: bool
    note: str = ""


@dataclass
class Campaign:
    seed: int
    faults: list[str]
    rows: list[Row] = field(default_factory=list)
    job_state: str = ""
    job_reason: str = ""
    leaks: list[str] = field(default_factory=list)
    steps_compared: int = 0
    differing: list[str] = field(default_factory=list)
    result: JobResult | None = field(default=None, repr=False)  # the chaos run's (not in JSON)

    @property
    def ok(self) -> bool:
        return (
            self.job_state == "succeeded"
            and not self.leaks
            and not self.differing
            and all(r.bit_exact and r.step is not None for r in self.rows)
        )


def run_campaign(
    script: list[str],
    seed: int,
    faults: int,
    nodes: int = 3,
    nproc_per_node: int = 1,
    spares: int = 2,
    start: int = 5,
    every: int | None = None,
    heartbeat_timeout: float = 3.0,
    replicas: int | None = None,
    env: dict[str, str] | None = None,
    job: str | None = None,
    progress: bool = False,
    ray: str | None = None,
) -> Campaign:
    """Run the reference and the chaos run; with ``progress``, report how far each got (a
    bar on a terminal, plain lines otherwise). With ``ray`` (a Ray address) both run on that
    Ray cluster (``RayLauncher``): ``nodes`` Ray nodes hold ranks, ``spares`` spare Ray nodes,
    and the faults follow ``raysched``'s rules."""
    world = nodes * nproc_per_node
    draw: Draw
    if ray is None:
        draw = lambda n, first, gap: generate(  # noqa: E731
            seed, n, world, first, gap, heartbeat_timeout
        )
    else:
        check_ray_campaign(nodes, nproc_per_node, spares)
        draw = lambda n, first, gap: generate_ray(  # noqa: E731
            seed, n, nodes, nproc_per_node, spares, first, gap, heartbeat_timeout
        )
    parse_chaos("; ".join(draw(faults, start, every or MIN_EVERY)))
    common: dict[str, Any] = dict(
        script=script[0],
        args=script[1:],
        nodes=nodes,
        nproc_per_node=nproc_per_node,
        heartbeat_timeout=heartbeat_timeout,
        replicas=replicas,
        env=env or {},
        record_digests=True,
    )

    def launcher_of(spec: JobSpec) -> Any:
        if ray is None:
            return LocalLauncher(spec)
        from peerckpt.launch.ray import RayLauncher

        return RayLauncher(spec, address=ray)

    # The reference snapshots every step: any step the chaos run snapshots (at its own
    # interval, after a restore, in a re-run) is compared with the reference at that step.
    ref_env = {**common["env"], "PEERCKPT_SNAPSHOT_EVERY": "1"}
    ref_launcher = launcher_of(
        JobSpec(**{**common, "env": ref_env}, job=f"{job}_ref" if job else None)
    )
    with Report("reference run, no faults: committed step", None) as bar:
        if progress and hasattr(ref_launcher, "watchers"):  # the Ray driver has no view
            ref_launcher.watchers.append(_committed(bar))
        reference = ref_launcher.run()
    if reference.state is not JobOutcome.SUCCEEDED:
        campaign = Campaign(seed, [])
        campaign.job_state = "reference failed"
        campaign.job_reason = reference.reason
        return campaign
    steps = 1 + max(int(key.partition("/")[2]) for key in reference.digests)
    clauses = place(seed, faults, world, start, every, heartbeat_timeout, steps, draw)
    campaign = Campaign(seed, clauses)
    launcher = launcher_of(
        JobSpec(
            **common,
            spares=spares,
            chaos="; ".join(clauses),
            keep_spares=True,
            job=f"{job}_chaos" if job else None,
        )
    )
    with Report(f"chaos run: faults fired (seed {seed})", len(clauses)) as bar:
        if progress and hasattr(launcher, "watchers"):
            launcher.watchers.append(_fired(bar, launcher))
        result = launcher.run()
    campaign.result = result
    campaign.job_state, campaign.job_reason = result.state.value, result.reason
    campaign.leaks = leaks(result.job, getattr(launcher, "rundir", None))
    compare(campaign, reference, result)
    return campaign


def _committed(bar: Report) -> Callable[[JobStatus, JobView], None]:
    """A launcher watcher: the committed step, as the reference run's progress."""
    return lambda status, view: bar.update(view.committed_step or 0)


def _fired(bar: Report, launcher: Any) -> Callable[[JobStatus, JobView], None]:
    """A launcher watcher: the faults fired so far, as the chaos run's progress."""

    def watch(status: JobStatus, view: JobView) -> None:
        fired = launcher.chaos.fired if launcher.chaos is not None else []
        bar.update(sum(1 for c in fired if c.fired_at))

    return watch


def leaks(job: str, rundir: str | None) -> list[str]:
    """Whatever of job ``job`` is still there on this machine: processes, shared-memory
    files, its sockets (``rundir``; a job on Ray has one per host, each host's launcher
    removes its own, and any shared memory or process of the job left here still counts)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("PEERCKPT_JOB") == job and proc.status() != "zombie":
                found.append(f"process {proc.pid} ({' '.join(proc.cmdline()[:3])})")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    found += [
        f"shared memory {p}" for p in glob.glob(os.path.join(SHM_DIR, segment_prefix(job) + "*"))
    ]
    if rundir is not None and os.path.exists(rundir):
        found.append(f"run directory {rundir} (sockets)")
    return found


def _steps(digests: dict[str, list[str]]) -> dict[tuple[int, int], set[str]]:
    out = {}
    for key, values in digests.items():
        rank, _, step = key.partition("/")
        out[(int(rank), int(step))] = set(values)
    return out


def pulled_text(pulls: list[Pull], taken_over: bool = False) -> str:
    """A recovery's pulls as the table shows them: the bytes each rank's state crossed the
    network (``r1 370,981 B n2→n3``), or was copied within its new node's memory (from a
    replica held there: ``r3 343,024 B within n2``). ``taken_over``: a recovery that the
    next failure's recovery took over before it pulled anything (its pulls are that row's)."""
    if taken_over:
        return "in the next failure's recovery"
    parts = [
        f"r{p.rank} {p.bytes:,} B "
        + (f"within n{p.node}" if p.source == p.node else f"n{p.source}→n{p.node}")
        for p in pulls
        if p.bytes
    ]
    return ", ".join(parts) or "local copies only (no network)"


def compare(campaign: Campaign, reference: JobResult, run: JobResult) -> None:
    """Fill the rows and the overall comparison of every snapshot with the reference. The
    reference snapshotted every step (``PEERCKPT_SNAPSHOT_EVERY=1``): whatever steps the
    chaos run snapshotted (its own interval, restores, re-runs), each is compared with the
    reference's state at that same step, and a difference names the first tensor."""
    expected, got = _steps(reference.digests), _steps(run.digests)
    campaign.steps_compared = len(got)
    campaign.differing = [
        difference(rank, step, seen, reference, run)
        for (rank, step), seen in sorted(got.items())
        if not seen <= expected.get((rank, step), set())
    ]
    fired = run.chaos
    rows_by_fault = {id(c): r for r, c in _pair(run)}
    by_text = {c.action: c for c in fired}
    for i, clause in enumerate(campaign.faults):
        record = by_text.get(clause)
        if record is None or record.fired_at is None:
            why = (record.skipped or "") if record else "the job ended before its step"
            campaign.rows.append(Row(clause, None, None, None, "", False, f"never fired: {why}"))
            continue
        struck = record.step or 0
        nxt = next(
            (
                by_text[c].step
                for c in campaign.faults[i + 1 :]
                if c in by_text and by_text[c].fired_at is not None
            ),
            None,
        )
        window = {k for k in got if k[1] >= struck and (nxt is None or k[1] < max(nxt, struck + 1))}
        if not window:  # none between this fault and the next: the first snapshot after it
            later = sorted((k for k in got if k[1] >= struck), key=lambda k: k[1])
            window = {k for k in later if later and k[1] == later[0][1]}
        exact = bool(window) and all(got[k] <= expected.get(k, set()) for k in window)
        failure = rows_by_fault.get(id(record))
        pulled = ""
        if failure is not None:
            # a recovery a later failure took over pulled nothing itself
            pulled = pulled_text(failure.pulls, failure.superseded and not failure.pulls)
        note = "" if failure else "no rank was lost"
        if not window:
            note = "no snapshot after it to compare"
        campaign.rows.append(
            Row(
                clause,
                struck,
                failure.detected_s if failure else None,
                failure.recovered_s if failure else None,
                pulled,
                exact,
                note,
            )
        )


def difference(rank: int, step: int, seen: set[str], reference: JobResult, run: JobResult) -> str:
    """What differs in rank ``rank``'s snapshot of ``step``: the first tensor (in chunk
    order) whose digest is not the reference's at that step."""
    wanted = reference.digests.get(f"{rank}/{step}", [])
    if not wanted:
        return f"rank {rank} step {step}: the fault-free run has no snapshot of that step"
    ref = reference.tensor_digests.get(f"{rank}/{step}/{wanted[0]}", {})
    for digest in sorted(seen - set(wanted)):
        got = run.tensor_digests.get(f"{rank}/{step}/{digest}", {})
        keys = [k for k, v in got.items() if ref.get(k) != v] + sorted(set(ref) - set(got))
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            return f"rank {rank} step {step}: tensor {keys[0]!r} differs{more}"
    return f"rank {rank} step {step}: its tensors differ"


def _pair(run: JobResult) -> list[tuple[FailureRow, FiredAction]]:
    """(failure row, the chaos record that caused it) for every injected failure: the pairs
    ``report.causes`` made, not a second match by the clause's text."""
    rows = failure_rows(run.events, run.chaos)
    found = causes(run.events, run.chaos)
    return [(row, cause) for row, cause in zip(rows, found, strict=True) if cause is not None]


def format_table(campaign: Campaign) -> str:
    head = ("fault", "step", "detected", "recovered", "pulled", "bit-exact")
    rows = [head]
    for r in campaign.rows:
        rows.append(
            (
                r.fault,
                "-" if r.step is None else str(r.step),
                "-" if r.detected_s is None else f"{r.detected_s:.3f} s",
                "-" if r.recovered_s is None else f"{r.recovered_s:.3f} s",
                r.pulled or r.note or "-",
                "yes" if r.bit_exact else "NO",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.append(
        f"job {campaign.job_state}{': ' + campaign.job_reason if campaign.job_reason else ''}; "
        f"{campaign.steps_compared} snapshots compared with the fault-free run, "
        f"{len(campaign.differing)} differ{': ' + ', '.join(campaign.differing[:5]) if campaign.differing else ''}; "
        f"leaks: {', '.join(campaign.leaks) if campaign.leaks else 'none'}"
    )
    lines.append("campaign " + ("passed" if campaign.ok else "FAILED"))
    return "\n".join(lines)


def to_json(campaign: Campaign) -> dict[str, Any]:
    out = asdict(campaign)
    out.pop("result")  # written apart, as the chaos run's report
    out["ok"] = campaign.ok
    return out


def default_json_path(seed: int, parent: str) -> str:
    """Where a campaign's rows go unless told: ``campaign.json`` in a new private directory
    in ``parent`` (the script's, or ``--out``), never a fixed name in a shared one."""
    return os.path.join(private_dir(parent, f"peerckpt-chaos-seed{seed}-"), "campaign.json")


def write_json(campaign: Campaign, path: str) -> None:
    write_private(path, json.dumps(to_json(campaign), indent=2))
