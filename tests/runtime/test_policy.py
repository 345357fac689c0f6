"""The snapshot interval chosen from measured costs: within the overhead budget, against
Young/Daly when the failure rate is given, and the calibration that measures the costs."""

from __future__ import annotations

import math

import pytest

from peerckpt.errors import ConfigurationError
from peerckpt.runtime.policy import (
    MAX_EVERY,
    PLAIN,
    SNAPSHOT_AT,
    SPREAD,
    Calibration,
    SnapshotPolicy,
    choose_interval,
)


@pytest.mark.parametrize(
    ("cost", "step", "overhead", "every"),
    [
        (0.0, 0.2, 0.05, 1),  # free snapshots (the GPU path): every step
        (0.0005, 0.2, 0.05, 1),  # +0.25 %: every step
        (0.01, 0.2, 0.05, 1),  # exactly the budget
        (0.011, 0.2, 0.05, 2),
        (0.232, 0.251, 0.05, 19),  # 256 MiB on this machine: +105 % every step
        (0.781, 0.360, 0.05, 44),  # 1 GiB: +240 %
        (0.232, 0.251, 0.20, 5),
        (1e6, 0.1, 0.05, MAX_EVERY),
    ],
)
def test_the_interval_keeps_the_overhead_within_the_budget(cost, step, overhead, every) -> None:
    got = choose_interval(cost, step, overhead)
    assert got.every == every and got.rule == "budget"
    if every < MAX_EVERY:
        assert got.expected_overhead <= overhead + 1e-12
        if every > 1:  # and no smaller interval would
            assert cost / ((every - 1) * step) > overhead
    assert got.expected_lost_s == pytest.approx((every / 2 + 1) * step)


def test_young_daly_is_used_only_where_it_snapshots_less_often() -> None:
    # C = 0.232 s, T = 0.251 s: the budget needs n ≥ 19
    rare = choose_interval(0.232, 0.251, 0.05, mtbf_s=3600.0)  # sqrt(2·C·MTBF) = 40.9 s
    assert rare.young_daly_every == round(math.sqrt(2 * 0.232 * 3600) / 0.251) == 163
    assert rare.every == 163 and rare.rule == "young-daly"
    assert rare.expected_overhead < 0.05
    often = choose_interval(0.232, 0.251, 0.05, mtbf_s=60.0)  # failures every minute
    assert often.young_daly_every == 21 and often.budget_every == 19
    assert often.every == 21
    frequent = choose_interval(0.232, 0.251, 0.05, mtbf_s=10.0)  # Young/Daly: 9 steps
    assert frequent.young_daly_every == 9 and frequent.every == 19 and frequent.rule == "budget"
    assert "Young/Daly interval 9 step(s)" in frequent.describe()


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 2.0])
def test_an_overhead_outside_zero_to_one_is_refused_naming_the_fix(bad) -> None:
    with pytest.raises(ConfigurationError, match="fraction of the step time"):
        SnapshotPolicy(overhead=bad)


def test_bad_intervals_and_mtbf_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="every=0"):
        SnapshotPolicy(every=0)
    with pytest.raises(ConfigurationError, match="mtbf"):
        SnapshotPolicy(mtbf_s=-1.0)


def test_calibration_measures_plain_steps_then_one_snapshots_whole_cost_then_decides() -> None:
    """Plain steps of 0.20 s; the snapshot's step and the four it shares the cores with take
    0.26 s each (+0.30 s), and its commit came 0.10 s after them: C = 0.40 s, n = 40."""
    policy = SnapshotPolicy(overhead=0.05)
    policy.begin_epoch(start=5, restored_every=None)
    durations = {o: 0.20 for o in PLAIN} | {o: 0.26 for o in SPREAD}
    due, quiet = [], []
    for step in range(5, 15):
        if policy.quiet_before(step):
            quiet.append(step)
            policy.waited(step, 0.5)  # before the plain steps: not a cost
        assert not policy.ready(step)
        due.append(policy.due(step))
        policy.record(step, durations.get(step - 5, 0.3))
    assert [s for s, d in zip(range(5, 15), due, strict=True) if d] == [
        5 + o for o in sorted(SNAPSHOT_AT)
    ]
    assert quiet == [5 + PLAIN[0]]
    assert not set(PLAIN) & SNAPSHOT_AT and SPREAD[0] in SNAPSHOT_AT
    assert not set(SPREAD[1:]) & SNAPSHOT_AT
    # once the snapshot's spread is over, the loop waits for its commit, then decides: at
    # a fixed step, the same on every rank (the agreement is a collective)
    assert policy.quiet_before(15)
    policy.waited(15, 0.10)
    assert policy.ready(15)
    mine = policy.local_choice()
    assert (mine.snapshot_cost_s, mine.step_s) == pytest.approx((0.40, 0.20))
    assert mine.every == 40
    policy.agree(45, mine, 15)  # another rank measured more
    assert not policy.ready(16) and not policy.quiet_before(7) and not policy.quiet_before(15)
    # after the step it was agreed before (its snapshot carries n), then every 45th
    assert [s for s in range(15, 100) if policy.due(s)] == [15, 45, 90]


def test_a_snapshot_whose_replication_outlasts_the_measured_steps_still_counts_whole() -> None:
    """On 2 busy cores the agents fall behind: the steps look cheap, the wait for the
    commit does not (a snapshot after every step, as measured first, hid it)."""
    calibration = Calibration(0)
    for o in PLAIN:
        calibration.record(o, 0.20)
    for o in SPREAD:
        calibration.record(o, 0.21)
    calibration.waited(SPREAD[-1] + 1, 0.60)
    cost, step = calibration.costs()
    assert cost == pytest.approx(0.65)
    assert choose_interval(cost, step, 0.05).every == 65


def _costs(plain: tuple[float, ...], spread: tuple[float, ...]) -> tuple[float, float]:
    """(C, T) of a calibration whose plain steps and measured snapshot's steps took these."""
    calibration = Calibration(0)
    for o, seconds in zip(PLAIN + SPREAD, plain + spread, strict=True):
        calibration.record(o, seconds)
    return calibration.costs()


def test_a_snapshots_cost_is_measured_against_the_median_plain_step() -> None:
    cost, step = _costs((0.20, 0.26, 0.21), (0.22, 0.20, 0.21, 0.20, 0.21))
    assert (cost, step) == (pytest.approx(0.0), pytest.approx(0.21))
    assert choose_interval(cost, step, 0.05).every == 1
    # One slow plain step is not taken for the plain step time (against the slowest one,
    # as measured first, this snapshot cost nothing and n = 1 overran the budget).
    cost, step = _costs((0.20, 0.26, 0.20), (0.26, 0.22, 0.22, 0.20, 0.20))
    assert cost == pytest.approx(0.10)
    assert choose_interval(cost, step, 0.05).every == 10


def test_a_restored_interval_or_a_fixed_one_is_used_without_measuring() -> None:
    policy = SnapshotPolicy(overhead=0.05)
    policy.begin_epoch(start=31, restored_every=10)
    assert not policy.ready(41) and [s for s in range(31, 61) if policy.due(s)] == [40, 50, 60]
    fixed = SnapshotPolicy(every=3)
    fixed.begin_epoch(start=0, restored_every=10)
    assert [s for s in range(0, 10) if fixed.due(s)] == [0, 3, 6, 9]
