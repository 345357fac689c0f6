"""The snapshot interval chosen from measured costs: within the overhead budget, against
Young/Daly when the failure rate is given, and the calibration that measures the costs."""

from __future__ import annotations

import math

import pytest

from peerckpt.errors import ConfigurationError
from peerckpt.runtime.policy import (
    CYCLES,
    DECIDE_AT,
    MAX_EVERY,
    PLAIN,
    SNAPSHOT_AT,
    Agreement,
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
    got = choose_interval(cost, step, overhead, max_lost_s=1e9)
    assert got.every == every and got.rule == "budget"
    if every < MAX_EVERY:
        assert got.expected_overhead <= overhead + 1e-12
        if every > 1:  # and no smaller interval would
            assert cost / ((every - 1) * step) > overhead
    assert got.expected_lost_s == pytest.approx((every / 2 + 1) * step)


def test_young_daly_is_used_only_where_it_snapshots_less_often() -> None:
    # C = 0.232 s, T = 0.251 s: the budget needs n ≥ 19
    rare = choose_interval(
        0.232, 0.251, 0.05, mtbf_s=3600.0, max_lost_s=1e9
    )  # √(2·C·MTBF) = 40.9 s
    assert rare.young_daly_every == round(math.sqrt(2 * 0.232 * 3600) / 0.251) == 163
    assert rare.every == 163 and rare.rule == "young-daly"
    assert rare.expected_overhead < 0.05
    # the default bound on the work lost (5 s: 19 steps) wins over Young/Daly's 41 s
    assert choose_interval(0.232, 0.251, 0.05, mtbf_s=3600.0).every == 19
    often = choose_interval(0.232, 0.251, 0.05, mtbf_s=60.0, max_lost_s=1e9)
    assert often.young_daly_every == 21 and often.budget_every == 19
    assert often.every == 21
    frequent = choose_interval(0.232, 0.251, 0.05, mtbf_s=10.0, max_lost_s=1e9)  # Y/D: 9 steps
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


def _calibrated(
    plain: float | list[float], cycles: list[list[float]], waits: list[float]
) -> Calibration:
    """A calibration whose plain steps, cycles' steps and waits for commits took these."""
    calibration = Calibration(0)
    plains = plain if isinstance(plain, list) else [plain] * len(PLAIN)
    for o, seconds in zip(PLAIN, plains, strict=True):
        calibration.record(o, seconds)
    for cycle, durations in zip(CYCLES, cycles, strict=True):
        for o, seconds in zip(cycle, durations, strict=True):
            calibration.record(o, seconds)
    for o, seconds in zip((10, 14, 18), waits, strict=True):
        calibration.waited(o, seconds)
    return calibration


def test_calibration_measures_plain_steps_then_three_snapshots_then_decides() -> None:
    """Plain steps of 0.20 s; each snapshot's cycle takes 0.26 s a step (+0.24 s over four
    steps) and its commit comes 0.10 s after them: C = 0.34 s, n = 34."""
    policy = SnapshotPolicy(overhead=0.05, max_lost_s=60.0)
    policy.begin_epoch(start=5, restored_every=None)
    cycle_steps = {o for cycle in CYCLES for o in cycle}
    due, quiet = [], []
    for step in range(5, 5 + DECIDE_AT):
        if policy.quiet_before(step):
            quiet.append(step - 5)
            policy.waited(step, 0.5 if step - 5 == 2 else 0.10)  # the first is not a cost
        assert not policy.ready(step)
        due.append(policy.due(step))
        policy.record(step, 0.26 if step - 5 in cycle_steps else 0.20)
    assert [s - 5 for s, d in zip(range(5, 5 + DECIDE_AT), due, strict=True) if d] == sorted(
        SNAPSHOT_AT
    )
    assert {0, 1, 6, 10, 14} == SNAPSHOT_AT and not set(PLAIN) & SNAPSHOT_AT
    # before the plain steps, and after each cycle: the wait for its snapshot's commit
    assert quiet == [2, 10, 14, 18]
    # decided at a fixed step, the same on every rank (the agreement is a collective)
    assert policy.ready(5 + DECIDE_AT)
    cost, step = policy.measured()
    assert (cost, step) == pytest.approx((0.34, 0.20))
    chosen = policy.agree([(cost, step), (0.50, 0.20), (0.30, 0.21)], 5 + DECIDE_AT, speak=True)
    assert chosen.every == 34 and policy.every == 34  # the medians: C 0.34 s, T 0.20 s
    assert not policy.ready(5 + DECIDE_AT + 1)
    # after the step it was agreed before (its snapshot carries n), then every 34th
    assert [s for s in range(27, 100) if policy.due(s)] == [27, 34, 68]


def test_one_slow_cycle_or_one_slow_rank_does_not_move_the_interval() -> None:
    steady = _calibrated(0.10, [[0.12] * 4] * 3, [0.02] * 3)
    hiccup = _calibrated(0.10, [[0.12] * 4, [0.12, 0.55, 0.12, 0.12], [0.12] * 4], [0.02] * 3)
    assert steady.costs() == pytest.approx((0.10, 0.10))
    assert hiccup.costs() == pytest.approx((0.10, 0.10))  # the median of the three cycles
    assert sorted(hiccup.cycle_costs()) == pytest.approx([0.10, 0.10, 0.53])
    # a rank that measured 0.46 s against three that measured 0.10 s: named, not followed
    together = Agreement.of([(0.10, 0.10), (0.46, 0.10), (0.11, 0.10), (0.09, 0.10)])
    assert together.snapshot_cost_s == pytest.approx(0.105) and set(together.outliers) == {1}


def test_a_snapshot_whose_replication_outlasts_its_steps_still_counts_whole() -> None:
    """On 2 busy cores the agents fall behind: the steps look cheap, the wait for the
    commit does not (a snapshot after every step, as measured first, hid it)."""
    cost, step = _calibrated(0.20, [[0.21] * 4] * 3, [0.60] * 3).costs()
    assert cost == pytest.approx(0.64)
    assert choose_interval(cost, step, 0.05, max_lost_s=60.0).every == 64


def test_a_snapshots_cost_is_measured_against_the_median_plain_step() -> None:
    # One slow plain step is not taken for the plain step time (against the slowest one,
    # as measured first, this snapshot cost nothing and n = 1 overran the budget).
    plain = [0.20, 0.26, 0.20, 0.20, 0.21, 0.20, 0.20, 0.20]
    cost, step = _calibrated(plain, [[0.26, 0.22, 0.22, 0.20]] * 3, [0.0] * 3).costs()
    assert (cost, step) == pytest.approx((0.10, 0.20))
    assert choose_interval(cost, step, 0.05).every == 10


def test_the_work_a_failure_may_lose_bounds_the_interval() -> None:
    # the budget alone would take 44 steps of 0.36 s (15.8 s of training lost at worst)
    bounded = choose_interval(0.781, 0.360, 0.05, max_lost_s=5.0)
    assert bounded.budget_every == 44 and bounded.every == 13 and bounded.rule == "max-lost"
    assert bounded.every * 0.360 <= 5.0 < (bounded.every + 1) * 0.360
    assert "raise resilient(max_lost=…)" in bounded.describe()
    assert choose_interval(0.781, 0.360, 0.05, max_lost_s=60.0).every == 44
    assert choose_interval(0.1, 10.0, 0.05, max_lost_s=5.0).every == 1  # longer steps: each
    with pytest.raises(ConfigurationError, match="max_lost"):
        SnapshotPolicy(max_lost_s=0.0)


def test_a_restored_interval_or_a_fixed_one_is_used_without_measuring() -> None:
    policy = SnapshotPolicy(overhead=0.05)
    policy.begin_epoch(start=31, restored_every=10)
    assert not policy.ready(41) and [s for s in range(31, 61) if policy.due(s)] == [40, 50, 60]
    fixed = SnapshotPolicy(every=3)
    fixed.begin_epoch(start=0, restored_every=10)
    assert [s for s in range(0, 10) if fixed.due(s)] == [0, 3, 6, 9]
