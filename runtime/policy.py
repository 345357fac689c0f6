"""How often a rank snapshots: every step, every n steps given, or n chosen for an overhead.

``resilient(overhead=f)`` (default 0.05) asks that snapshots add at most a fraction f to the
step time. What a snapshot costs a step depends on the machine — on a GPU node the copy runs
on a side stream and the agents have cores of their own (+0.3 % measured on an H100); on a
CPU machine whose cores the ranks keep busy the agents' checksums and sends take CPU from
training (+20 % to +250 % measured here with a snapshot every step). So the runtime measures
it over the first steps of a job (``Calibration``): steps without a snapshot (T, their
median), then one snapshot and the steps its copy and replication share the cores with, then
the wait for its commit; the cost C of a snapshot is what those steps took beyond T, plus
that wait, and

    n = ceil(C / (f · T))                      (T: the step time without snapshots)

keeps the overhead C / (n · T) within f (``choose_interval``, a pure function). Given the
mean time between failures (``mtbf=`` seconds), the Young/Daly interval sqrt(2 · C · MTBF)
minimises the expected time lost to checkpoints and re-done work together; the runtime takes
the larger of the two (fewer snapshots than the budget allows only when Young/Daly says so,
never more than it allows). The ranks agree on the largest n (an all-reduce), and n travels
in every snapshot, so that a restored or replacement rank uses the same n without measuring.
``resilient(every=n)`` fixes the interval and measures nothing.

Snapshots are taken after the steps ``step % n == 0``, and after the step the ranks
agreed on n before. This module decides when; it never
copies and never talks to the agent.
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
# snapshot work is left when 2..5 run without one (plain steps). Then three *cycles*: one
# snapshot after the cycle's first step, whose copy and replication share the cores with its
# other steps, and before the next cycle the loop waits for that snapshot's commit, a wait
# that is part of its cost (work that would otherwise have slowed later steps). Four plain
# steps close it (the machine's drift between the two plain groups counts as noise, not as
# the snapshots' cost). The offsets are fixed, never when a rank happens to see a commit:
# the ranks agree on n by a collective, at the same step on every rank.
#
# One measured snapshot, as this did first, chose n from 1 to 91 for one job on a loaded
# 2-core machine (one rank's estimate of 1.4 MB ranged 0–463 ms): one slow step decided. A
# cycle's cost is now the median of three, and the job's the median over its ranks.
PLAIN = (2, 3, 4, 5, 18, 19, 20, 21)
CYCLES = ((6, 7, 8, 9), (10, 11, 12, 13), (14, 15, 16, 17))
SNAPSHOT_AT = frozenset({0, 1, *(cycle[0] for cycle in CYCLES)})
QUIET_AT = frozenset({2, *(cycle[0] for cycle in CYCLES[1:]), 18})  # each after a cycle
DECIDE_AT = 22
OUTLIER = 3.0  # a rank whose snapshot cost is this many times the median's is named
DEFAULT_MAX_LOST_S = 5.0  # the most work a failure may lose by default (n · T)


@dataclass(frozen=True)
class Interval:
    """The chosen snapshot interval and what it was chosen from."""

    every: int  # snapshot after every ``every``-th step
    budget_every: int  # the smallest n that keeps the overhead within the budget
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
            f"expected overhead {self.expected_overhead:.1%} (budget {self.overhead:.0%}), "
            f"expected work lost per failure {self.expected_lost_s:.2f} s, at most "
            f"{self.every * self.step_s:.2f} s (max_lost {self.max_lost_s:g} s)"
        )
        if self.young_daly_every is not None:
            text += f"; Young/Daly interval {self.young_daly_every} step(s)"
        if self.rule == "max-lost":
            text += (
                f"; the budget alone would snapshot every {self.budget_every} step(s): raise "
                "resilient(max_lost=…) to lose more work per failure for less overhead"
            )
        return text


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


class Calibration:
    """Step times over the calibration's steps, by offset from its first step."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.durations: dict[int, float] = {}
        self.waits: dict[int, float] = {}  # offset → seconds waited for a commit before it

    def snapshot_due(self, step: int) -> bool:
        return step - self.start in SNAPSHOT_AT

    def record(self, step: int, seconds: float) -> None:
        self.durations[step - self.start] = seconds

    def quiet_before(self, step: int) -> bool:
        """Should the loop wait for the last snapshot's commit before ``step`` runs?"""
        return step - self.start in QUIET_AT

    def waited(self, step: int, seconds: float) -> None:
        self.waits[step - self.start] = seconds

    def ready(self, step: int) -> bool:
        """All measured: the interval can be chosen before ``step`` runs."""
        measured = PLAIN + tuple(o for cycle in CYCLES for o in cycle)
        return step - self.start >= DECIDE_AT and all(o in self.durations for o in measured)

    def cycle_costs(self) -> list[float]:
        """What each cycle's snapshot cost: its steps beyond the plain median T each, and the
        wait for its commit after them (at the next cycle's start, or the closing plain
        steps')."""
        plain = self.plain_step()
        after = [cycle[0] for cycle in CYCLES[1:]] + [PLAIN[len(PLAIN) // 2]]
        return [
            sum(self.durations[o] - plain for o in cycle) + self.waits.get(wait, 0.0)
            for cycle, wait in zip(CYCLES, after, strict=True)
        ]

    def plain_step(self) -> float:
        """T: the median of the plain steps (against the slowest one, as this did first, C
        was biased low by their spread)."""
        return statistics.median(self.durations[o] for o in PLAIN)

    def costs(self) -> tuple[float, float]:
        """(C, T) of this rank: the median of the cycles' costs, the plain steps' median.
        Noise errs either way; a C below f · T still gives n = 1."""
        return max(0.0, statistics.median(self.cycle_costs())), self.plain_step()


@dataclass(frozen=True)
class Agreement:
    """What the ranks' measurements say together: the medians over ranks, and the ranks
    whose snapshot cost stood out (named in the log, left to the median)."""

    snapshot_cost_s: float
    step_s: float
    outliers: dict[int, float]  # rank → its snapshot cost, seconds

    @staticmethod
    def of(measured: list[tuple[float, float]]) -> Agreement:
        """``measured``: every rank's (C, T), by rank."""
        cost = statistics.median(c for c, _ in measured)
        step = statistics.median(t for _, t in measured)
        outliers = {
            rank: c
            for rank, (c, _) in enumerate(measured)
            if c > OUTLIER * cost and c - cost > step
        }
        return Agreement(cost, step, outliers)


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

    def waited(self, step: int, seconds: float) -> None:
        """The loop waited ``seconds`` for a commit before ``step`` (``quiet_before``)."""
        if self._calibration is not None:
            self._calibration.waited(step, seconds)

    def measured(self) -> tuple[float, float]:
        """This rank's (C, T), for the agreement."""
        assert self._calibration is not None
        return self._calibration.costs()

    def agree(self, measured: list[tuple[float, float]], step: int, speak: bool) -> Interval:
        """Every rank's (C, T) are known (the same list on every rank, by rank): choose n
        from their medians before ``step`` — the same n on every rank. ``speak``: this rank
        logs the choice (one rank does, once per job)."""
        together = Agreement.of(measured)
        interval = choose_interval(
            together.snapshot_cost_s, together.step_s, self.overhead, self.mtbf_s, self.max_lost_s
        )
        self.every, self._calibration, self._decided_at = interval.every, None, step
        self.interval = interval
        if speak:
            costs = sorted(c for c, _ in measured)
            text = (
                f"{interval.describe()}; the median of {len(measured)} rank(s), whose "
                f"snapshot costs ranged {costs[0] * 1e3:.0f}–{costs[-1] * 1e3:.0f} ms"
            )
            if together.outliers:
                text += "; outliers (left to the median): " + ", ".join(
                    f"rank {r} {c * 1e3:.0f} ms" for r, c in sorted(together.outliers.items())
                )
            log.info("%s", text)
        return interval
