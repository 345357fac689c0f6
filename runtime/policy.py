"""How often a rank snapshots: every step, every n steps given, or n chosen for an overhead.

``resilient(overhead=f)`` (default 0.05) asks that snapshots add at most a fraction f to the
step time. What a snapshot costs a step depends on the machine — on a GPU node the copy runs
on a side stream and the agents have cores of their own (+0.3 % measured on an H100); on a
CPU machine whose cores the ranks keep busy the agents' checksums and sends take CPU from
training (+20 % to +250 % measured here with a snapshot every step). So the runtime measures
it over the first steps of a job (``Calibration``), as *work*, not as slower steps:

- the CPU seconds the rank process (its copy thread included) and its node's agent spend on
  a snapshot: what five snapshots took beyond the plain steps' rate, each counted through
  the wait for its commit (the agents' backlog included), the mean of the middle three;
- the seconds the training loop was blocked by the snapshot engine (a copy not done when
  the next optimizer step came);
- what the cycles' steps took beyond T (wall clock), less twice its standard error: a cost
  no CPU clock sees (a training thread waiting for the GIL or for memory while a large copy
  runs) counts where it stands clear of the steps' noise.

Wall-clock step times on a shared machine are a poor measure of a cost of a few
milliseconds: with a second job beside it, steps of one job took 5–20 ms, and the costs
read off them chose intervals of 1 to 99 steps for one unchanged job (issue 24). CPU seconds
of work do not move with other people's load. The ranks then put their measurements
together (``Agreement``, the same on every rank, from one all-gather): the work of a
snapshot round on each machine (every rank's and every agent's there) is spread over the
cores that machine gives the job (its ranks, at most its cores), the slowest machine sets
the pace, and the blocked time (the median over ranks) adds to it; where the wall clock's
lower bound is larger, it is taken. That is C, what one snapshot adds to a step; T is the median plain step (wall clock), and

    n = ceil(C / (f · T))                      (T: the step time without snapshots)

keeps the overhead C / (n · T) within f (``choose_interval``, a pure function), rounded to the
nearest power of two (a cadence that reads the same from run to run; the overhead may then
exceed f by up to √2). Given the mean time between failures (``mtbf=`` seconds), the Young/Daly
interval sqrt(2 · C · MTBF) is used where it is longer. Whatever the budget says, n steps
never take longer than ``max_lost`` seconds (default 5): the work a failure may lose wins.
n travels in every snapshot, so that a restored or replacement rank uses the same n without
measuring. ``resilient(every=n)`` fixes the interval and measures nothing.

Snapshots are taken after the steps ``step % n == 0``, and after the step the ranks
agreed on n before. This module decides when; it never copies and never talks to the agent.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass

from peerckpt.errors import ConfigurationError

log = logging.getLogger("peerckpt.policy")

MAX_EVERY = 1000  # a bound on n whatever the measurement (a noisy step time near zero)
# Offsets from the first step of the calibration: snapshots after 0 and 1 (both slots are
# allocated: first touches); before 2 the loop waits for the commit of 1, so that no
# snapshot work is left when 2..5 run without one (plain steps). Then five *cycles* of three
# steps: one snapshot after the cycle's first step, whose copy and replication run beside
# its steps, and before the next cycle the loop waits for that snapshot's commit (its work
# is then done, and counted in its cycle). Four plain steps close it. The offsets are fixed,
# never when a rank happens to see a commit: the ranks agree on n by a collective, at the
# same step on every rank.
_CYCLE, _FIRST, _COUNT = 3, 6, 5
CYCLES = tuple(tuple(range(_FIRST + i * _CYCLE, _FIRST + (i + 1) * _CYCLE)) for i in range(_COUNT))
_AFTER = _FIRST + _COUNT * _CYCLE  # the first closing plain step
PLAIN = (2, 3, 4, 5, *range(_AFTER, _AFTER + 4))
SNAPSHOT_AT = frozenset({0, 1, *(cycle[0] for cycle in CYCLES)})
QUIET_AT = frozenset({2, *(cycle[0] for cycle in CYCLES[1:]), _AFTER})  # each after a cycle
DECIDE_AT = _AFTER + 4
OUTLIER = 3.0  # a rank whose own snapshot work is this many times the median's is named
DEFAULT_MAX_LOST_S = 5.0  # the most work a failure may lose by default (n · T)


@dataclass(frozen=True)
class Interval:
    """The chosen snapshot interval and what it was chosen from."""

    every: int  # snapshot after every ``every``-th step
    budget_every: int  # the smallest n that keeps the overhead within the budget (unrounded)
    young_daly_every: int | None  # sqrt(2 · C · MTBF) in steps, when MTBF is given
    snapshot_cost_s: float  # C: what one snapshot adds to the step time
    step_s: float  # T: a step without a snapshot
    overhead: float  # the budget f
    expected_overhead: float  # C / (n · T)
    expected_lost_s: float  # work re-done after a failure, on average: (n / 2 + 1) · T
    rule: str  # "budget", "young-daly", "max-lost" or "fixed"
    max_lost_s: float = DEFAULT_MAX_LOST_S  # the bound on n · T (work a failure may lose)

    def describe(self) -> str:
        text = (
            f"snapshot every {self.every} step(s) ({self.rule}): a snapshot costs "
            f"{self.snapshot_cost_s * 1e3:.0f} ms against a {self.step_s * 1e3:.0f} ms step, "
            f"expected overhead {self.expected_overhead:.1%} (budget {self.overhead * 100:g}%), "
            f"expected work lost per failure {self.expected_lost_s:.2f} s ({self.every}/2 + 1 "
            f"steps), {self.every} step(s) between snapshots {self.every * self.step_s:.2f} s "
            f"(max_lost {self.max_lost_s:g} s)"
        )
        if self.young_daly_every is not None:
            text += f"; Young/Daly interval {self.young_daly_every} step(s)"
        if self.rule == "max-lost":
            text += (
                f"; the budget alone would snapshot every {self.budget_every} step(s): raise "
                "resilient(max_lost=…) to lose more work per failure for less overhead"
            )
        elif self.expected_overhead > self.overhead * (1 + 1e-9):
            text += f"; above the budget: {self._over_budget()}"
        return text

    def _over_budget(self) -> str:
        """Why an interval not bounded by max_lost overruns the budget: the cap, or the
        rounding to a power of two (by design: at most √2 over, ``_power_of_two``)."""
        if self.budget_every >= MAX_EVERY:
            return f"no interval of up to {MAX_EVERY} steps keeps within it"
        unrounded = self.young_daly_every if self.rule == "young-daly" else self.budget_every
        return (
            f"{unrounded} step(s) rounded to the nearest power of two, {self.every}, a cadence "
            "that measurement noise does not change from run to run (at most √2 over); "
            f"resilient(every={self.budget_every}) keeps within it"
        )


def choose_interval(
    snapshot_cost_s: float,
    step_s: float,
    overhead: float,
    mtbf_s: float | None = None,
    max_lost_s: float = DEFAULT_MAX_LOST_S,
) -> Interval:
    """The snapshot interval for a snapshot costing ``snapshot_cost_s`` on steps of ``step_s``
    within the overhead budget ``overhead``, with ``mtbf_s`` the Young/Daly optimum when
    that snapshots less often, and never more than ``max_lost_s`` of steps between two
    snapshots (the work a failure may lose wins over the budget: the log says so)."""
    if not 0 < overhead < 1:
        raise ConfigurationError(
            f"resilient(overhead={overhead}): give the snapshot overhead as a fraction of the "
            "step time between 0 and 1, e.g. 0.05 for 5%"
        )
    if not max_lost_s > 0:
        raise ConfigurationError(
            f"resilient(max_lost={max_lost_s}): give the most work a failure may lose in "
            "seconds of training (> 0), e.g. 5.0"
        )
    cost, step = max(0.0, snapshot_cost_s), max(step_s, 1e-6)
    budget = min(MAX_EVERY, max(1, math.ceil(cost / (overhead * step) - 1e-9)))
    young_daly = None
    every, rule = budget, "budget"
    if mtbf_s is not None:
        young_daly = min(MAX_EVERY, max(1, round(math.sqrt(2 * cost * mtbf_s) / step)))
        if young_daly > budget:
            every, rule = young_daly, "young-daly"
    every = _power_of_two(every)
    bound = max(1, math.floor(max_lost_s / step + 1e-9))
    if every > bound:
        every, rule = bound, "max-lost"
    return Interval(
        every=every,
        budget_every=budget,
        young_daly_every=young_daly,
        snapshot_cost_s=cost,
        step_s=step,
        overhead=overhead,
        expected_overhead=cost / (every * step),
        expected_lost_s=(every / 2 + 1) * step,
        rule=rule,
        max_lost_s=max_lost_s,
    )


def _trimmed_mean(values: list[float]) -> float:
    """The mean without the largest and the smallest: one odd cycle moves nothing, and the
    other three average their noise down (CPU seconds have no wild outliers; a median of
    five kept one cycle's noise whole)."""
    kept = sorted(values)[1:-1] if len(values) > 2 else values
    return sum(kept) / len(kept)


def _power_of_two(n: int) -> int:
    """The power of two nearest ``n`` by ratio (5 → 4, 6 → 8, 22 → 16, 23 → 32): intervals
    that differ by noise read the same from run to run. Rounded up, as this did first, ten
    runs of one job beside another chose 16, 32 and 64 (measured n of about 16 to 38);
    rounded to the nearest, the overhead may exceed the budget by up to √2 (7 % for 5 %),
    as the budget's own noise here does."""
    if n <= 1:
        return 1
    return min(MAX_EVERY, 2 ** round(math.log2(n)))


@dataclass(frozen=True)
class Probe:
    """Counters read at a step boundary (after any wait for a commit): the wall clock, this
    process's CPU seconds (every thread), its node agent's CPU seconds, and the seconds the
    loop has been blocked by the snapshot engine so far."""

    wall: float
    own_cpu: float
    agent_cpu: float
    stalled: float


@dataclass(frozen=True)
class Measured:
    """What one rank measured: per snapshot, the CPU seconds it spent, the CPU seconds its
    node's agent spent (on the snapshot round of all the node's ranks: checksums, pushes,
    the replicas it received), the seconds the loop was blocked; T, and the CPU seconds of
    a plain step (the training work the snapshot's work is measured against)."""

    own_cpu_s: float
    agent_cpu_s: float
    stalled_s: float
    step_s: float
    step_cpu_s: float = 0.0  # the CPU seconds this process spends on a plain step
    wall_low_s: float = 0.0  # what the cycles' steps took beyond T, less twice its error


class Calibration:
    """Step times and probes over the calibration's steps, by offset from its first step."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.durations: dict[int, float] = {}
        self.probes: dict[int, Probe] = {}  # offset → counters at that step's start

    def snapshot_due(self, step: int) -> bool:
        return step - self.start in SNAPSHOT_AT

    def record(self, step: int, seconds: float) -> None:
        self.durations[step - self.start] = seconds

    def probe(self, step: int, probe: Probe) -> None:
        """The counters at the start of ``step``, after any wait for a commit."""
        self.probes[step - self.start] = probe

    def quiet_before(self, step: int) -> bool:
        """Should the loop wait for the last snapshot's commit before ``step`` runs?"""
        return step - self.start in QUIET_AT

    def ready(self, step: int) -> bool:
        """All measured: the interval can be chosen before ``step`` runs."""
        bounds = {2, 6, *(c[0] for c in CYCLES), _AFTER, DECIDE_AT}
        return (
            step - self.start >= DECIDE_AT
            and all(o in self.durations for o in PLAIN)
            and all(o in self.probes for o in bounds)
        )

    def plain_step(self) -> float:
        """T: the median of the plain steps' wall times."""
        return statistics.median(self.durations[o] for o in PLAIN)

    def _between(self, a: int, b: int) -> Probe:
        p, q = self.probes[a], self.probes[b]
        return Probe(
            q.wall - p.wall, q.own_cpu - p.own_cpu, q.agent_cpu - p.agent_cpu, q.stalled - p.stalled
        )

    def costs(self) -> Measured:
        """This rank's measurement: for each cycle, the CPU beyond the plain steps' rate (the
        rank's per step, the agent's per second) and the blocked time, from the cycle's
        start to the next one's (its commit waited for); over the five cycles, the mean of
        the middle three."""
        plain = [self._between(2, 6), self._between(_AFTER, DECIDE_AT)]
        own_per_step = sum(p.own_cpu for p in plain) / len(PLAIN)
        agent_per_s = sum(p.agent_cpu for p in plain) / max(1e-9, sum(p.wall for p in plain))
        own, agent, stalled, wall = [], [], [], []
        step = self.plain_step()
        for cycle in CYCLES:
            w = self._between(cycle[0], cycle[-1] + 1)
            own.append(w.own_cpu - len(cycle) * own_per_step)
            agent.append(w.agent_cpu - agent_per_s * w.wall)
            stalled.append(w.stalled)
            wall.append(sum(self.durations[o] - step for o in cycle))
        spread = statistics.stdev(wall) / math.sqrt(len(wall))
        return Measured(
            max(0.0, _trimmed_mean(own)),
            max(0.0, _trimmed_mean(agent)),
            max(0.0, _trimmed_mean(stalled)),
            step,
            own_per_step,
            max(0.0, statistics.mean(wall) - 2 * spread),
        )


@dataclass(frozen=True)
class RankReport:
    """One rank's part of the agreement: its measurement and where it runs (the machine, by
    a number equal on ranks of one machine; the cores it may use; its node)."""

    measured: Measured
    machine: int
    cores: int
    node: int

    def row(self) -> list[float]:
        m = self.measured
        fields = (m.own_cpu_s, m.agent_cpu_s, m.stalled_s, m.step_s, m.step_cpu_s, m.wall_low_s)
        return [*fields, float(self.machine), float(self.cores), float(self.node)]

    @staticmethod
    def of_row(row: list[float]) -> RankReport:
        return RankReport(Measured(*row[:6]), int(row[6]), int(row[7]), int(row[8]))


@dataclass(frozen=True)
class Agreement:
    """What the ranks' measurements say together (``RankReport`` by rank): C, T, and the
    ranks whose own snapshot work stood out (named in the log)."""

    snapshot_cost_s: float
    step_s: float
    work: dict[int, tuple[float, float]]  # machine → (snapshot round's CPU s, a step's CPU s)
    outliers: dict[int, float]  # rank → its own CPU seconds per snapshot

    @staticmethod
    def of(reports: list[RankReport]) -> Agreement:
        """On each machine, the CPU work of a snapshot round (its ranks' own, and once per
        node its agent's: the median of what that node's ranks read) against the CPU work
        of a training step there (its ranks' plain steps): a ratio that other people's load
        on the machine does not move, as it slows both alike. The largest ratio (the
        slowest machine sets the pace) times T, plus the median time the loop was blocked,
        is C — or, where larger, the median over ranks of what the cycles' wall time shows
        beyond twice its standard error."""
        machines: dict[int, list[RankReport]] = {}
        for report in reports:
            machines.setdefault(report.machine, []).append(report)
        work: dict[int, tuple[float, float]] = {}
        for machine, ranks in machines.items():
            nodes: dict[int, list[float]] = {}
            for r in ranks:
                nodes.setdefault(r.node, []).append(r.measured.agent_cpu_s)
            snapshot = sum(r.measured.own_cpu_s for r in ranks)
            snapshot += sum(statistics.median(agent) for agent in nodes.values())
            work[machine] = (snapshot, sum(r.measured.step_cpu_s for r in ranks))
        step = statistics.median(r.measured.step_s for r in reports)
        ratio = max((s / max(t, 1e-9) for s, t in work.values()), default=0.0)
        stalled = statistics.median(r.measured.stalled_s for r in reports)
        own = statistics.median(r.measured.own_cpu_s for r in reports)
        outliers = {
            rank: r.measured.own_cpu_s
            for rank, r in enumerate(reports)
            if r.measured.own_cpu_s > OUTLIER * own
            and r.measured.own_cpu_s - own > 0.1 * r.measured.step_cpu_s
        }
        # What the work misses — a training thread waiting for the GIL or for memory while a
        # large copy runs (256 MiB here: the work said 0.17 s, the steps showed ~0.5 s) —
        # shows in the steps' wall time, where a large cost stands clear of their noise:
        # where it does, the wall time's lower bound is taken instead.
        shown = statistics.median(r.measured.wall_low_s for r in reports)
        return Agreement(max(ratio * step + stalled, shown), step, work, outliers)


class SnapshotPolicy:
    """When this rank snapshots: ``every`` fixed, or measured for ``overhead``."""

    def __init__(
        self,
        every: int | None = None,
        overhead: float = 0.05,
        mtbf_s: float | None = None,
        max_lost_s: float = DEFAULT_MAX_LOST_S,
    ) -> None:
        if every is not None and every < 1:
            raise ConfigurationError(
                f"resilient(every={every}): give the snapshot interval in steps, 1 or more"
            )
        if mtbf_s is not None and mtbf_s <= 0:
            raise ConfigurationError(
                f"resilient(mtbf={mtbf_s}): give the mean time between failures in seconds (> 0)"
            )
        # checks the budget and the bound now, not after the calibration
        choose_interval(0.0, 1.0, overhead, max_lost_s=max_lost_s)
        self.fixed = every
        self.overhead, self.mtbf_s, self.max_lost_s = overhead, mtbf_s, max_lost_s
        self.every: int | None = every
        self.interval: Interval | None = None
        self._calibration: Calibration | None = None
        # the step the interval was agreed before: its snapshot carries it, so that a
        # restore in this epoch does not measure again
        self._decided_at: int | None = None

    def begin_epoch(self, start: int, restored_every: int | None) -> None:
        """An epoch resumes at ``start``; ``restored_every`` is the n its snapshot carried."""
        self._decided_at = None
        if self.fixed is None:
            self.every = restored_every
            self._calibration = None if restored_every else Calibration(start)

    def due(self, step: int) -> bool:
        """Snapshot after ``step``?"""
        if self.every is not None:
            return step % self.every == 0 or step == self._decided_at
        assert self._calibration is not None
        return self._calibration.snapshot_due(step)

    def record(self, step: int, seconds: float) -> None:
        if self._calibration is not None:
            self._calibration.record(step, seconds)

    def ready(self, step: int) -> bool:
        return self._calibration is not None and self._calibration.ready(step)

    def quiet_before(self, step: int) -> bool:
        return self._calibration is not None and self._calibration.quiet_before(step)

    def calibrating(self) -> bool:
        """Is this rank measuring now (the loop then probes every step's start)?"""
        return self._calibration is not None

    def probe(self, step: int, probe: Probe) -> None:
        """The counters at the start of ``step``, after any wait for a commit."""
        if self._calibration is not None:
            self._calibration.probe(step, probe)

    def measured(self) -> Measured:
        """This rank's measurement, for the agreement."""
        assert self._calibration is not None
        measured = self._calibration.costs()
        log.debug("calibration: %s; plain steps %s", measured, self._calibration.durations)
        return measured

    def agree(self, reports: list[RankReport], step: int, speak: bool) -> Interval:
        """Every rank's report is known (the same list on every rank, by rank): choose n
        before ``step`` — the same n on every rank. ``speak``: this rank logs the choice
        (one rank does, once per job)."""
        together = Agreement.of(reports)
        interval = choose_interval(
            together.snapshot_cost_s, together.step_s, self.overhead, self.mtbf_s, self.max_lost_s
        )
        self.every, self._calibration, self._decided_at = interval.every, None, step
        self.interval = interval
        if speak:
            machines = ", ".join(
                f"{s * 1e3:.1f} ms against {t * 1e3:.1f} ms" for s, t in together.work.values()
            )
            text = (
                f"{interval.describe()}; measured on {len(reports)} rank(s), the CPU work of "
                f"a snapshot round against a training step's, per machine: {machines}"
            )
            if together.outliers:
                text += "; rank(s) whose own work stood out: " + ", ".join(
                    f"rank {r} {c * 1e3:.1f} ms" for r, c in sorted(together.outliers.items())
                )
            log.info("%s", text)
        return interval
