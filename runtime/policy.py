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
# snapshot work is left when 2..4 run without one (the plain steps measured); then one
# snapshot after 5 (its capture and hand-off end step 5), whose copy and replication share
# the cores with 6..9; before 10 the loop waits for its commit, and that wait is part of its
# cost (work that would otherwise have slowed later steps). The offsets are fixed, never
# when a rank happens to see the commit: the ranks agree on n by a collective, at the same
# step on every rank. A snapshot after every step (as this measured first) hid half the cost
# on 2 cores: the agents fell behind, and the backlog landed after the measured steps.
SNAPSHOT_AT = frozenset({0, 1, 5})
QUIET_AT = frozenset({2, 10})
PLAIN = (2, 3, 4)
SPREAD = (5, 6, 7, 8, 9)  # the measured snapshot's step and the steps its work shares
DECIDE_AT = 10


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
    rule: str  # "budget", "young-daly" or "fixed"

    def describe(self) -> str:
        text = (
            f"snapshot every {self.every} step(s) ({self.rule}): a snapshot costs "
            f"{self.snapshot_cost_s * 1e3:.0f} ms against a {self.step_s * 1e3:.0f} ms step, "
            f"expected overhead {self.expected_overhead:.1%} (budget {self.overhead:.0%}), "
            f"expected work lost per failure {self.expected_lost_s:.2f} s"
        )
        if self.young_daly_every is not None:
            text += f"; Young/Daly interval {self.young_daly_every} step(s)"
        return text


def choose_interval(
    snapshot_cost_s: float, step_s: float, overhead: float, mtbf_s: float | None = None
) -> Interval:
    """The snapshot interval for a snapshot costing ``snapshot_cost_s`` on steps of ``step_s``
    within the overhead budget ``overhead``, and with ``mtbf_s`` the Young/Daly optimum."""
    if not 0 < overhead < 1:
        raise ConfigurationError(
            f"resilient(overhead={overhead}): give the snapshot overhead as a fraction of the "
            "step time between 0 and 1, e.g. 0.05 for 5%"
        )
    cost, step = max(0.0, snapshot_cost_s), max(step_s, 1e-6)
    budget = min(MAX_EVERY, max(1, math.ceil(cost / (overhead * step) - 1e-9)))
    young_daly = None
    every, rule = budget, "budget"
    if mtbf_s is not None:
        young_daly = min(MAX_EVERY, max(1, round(math.sqrt(2 * cost * mtbf_s) / step)))
        if young_daly > budget:
            every, rule = young_daly, "young-daly"
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
        return step - self.start >= DECIDE_AT and all(o in self.durations for o in PLAIN + SPREAD)

    def costs(self) -> tuple[float, float]:
        """(C, T): a snapshot's cost and the plain step time. T is the plain steps' median;
        C what the measured snapshot's step and the four after it took beyond T each, and
        the wait for its commit after them. (C against the slowest plain step, as this did
        first, was biased low by their spread.) Noise errs either way; a C below f · T still
        gives n = 1."""
        plain = statistics.median(self.durations[o] for o in PLAIN)
        extra = sum(self.durations[o] - plain for o in SPREAD)
        return max(0.0, extra + self.waits.get(DECIDE_AT, 0.0)), plain


class SnapshotPolicy:
    """When this rank snapshots: ``every`` fixed, or measured for ``overhead``."""

    def __init__(
        self, every: int | None = None, overhead: float = 0.05, mtbf_s: float | None = None
    ) -> None:
        if every is not None and every < 1:
            raise ConfigurationError(
                f"resilient(every={every}): give the snapshot interval in steps, 1 or more"
            )
        if mtbf_s is not None and mtbf_s <= 0:
            raise ConfigurationError(
                f"resilient(mtbf={mtbf_s}): give the mean time between failures in seconds (> 0)"
            )
        choose_interval(0.0, 1.0, overhead)  # checks the budget now, not after 10 steps
        self.fixed = every
        self.overhead, self.mtbf_s = overhead, mtbf_s
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

    def local_choice(self) -> Interval:
        assert self._calibration is not None
        cost, step = self._calibration.costs()
        return choose_interval(cost, step, self.overhead, self.mtbf_s)

    def agree(self, every: int, mine: Interval, step: int) -> None:
        """The ranks agreed on ``every`` (the largest of their choices) before ``step``."""
        self.every, self._calibration, self._decided_at = every, None, step
        self.interval = mine
        log.info(
            "%s; the ranks agreed on every %d step(s) (expected work lost per failure %.2f s)",
            mine.describe(),
            every,
            (every / 2 + 1) * mine.step_s,
        )
