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
    Measured,
    Probe,
    RankReport,
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
    assert got.budget_every == every and got.rule == "budget"
    if every < MAX_EVERY:
        assert cost / (every * step) <= overhead + 1e-12
        if every > 1:  # and no smaller interval would
            assert cost / ((every - 1) * step) > overhead
        # chosen: the nearest power of two by ratio (the overhead within √2 of the budget)
        assert got.every & (got.every - 1) == 0
        assert every / math.sqrt(2) <= got.every <= every * math.sqrt(2)
        assert got.expected_overhead <= overhead * math.sqrt(2) + 1e-12
    assert got.expected_lost_s == pytest.approx((got.every / 2 + 1) * step)


def test_young_daly_is_used_only_where_it_snapshots_less_often() -> None:
    # C = 0.232 s, T = 0.251 s: the budget needs n ≥ 19
    rare = choose_interval(
        0.232, 0.251, 0.05, mtbf_s=3600.0, max_lost_s=1e9
    )  # √(2·C·MTBF) = 40.9 s
    assert rare.young_daly_every == round(math.sqrt(2 * 0.232 * 3600) / 0.251) == 163
    assert rare.every == 128 and rare.rule == "young-daly"  # 163, the nearest power of two
    assert rare.expected_overhead < 0.05
    # the default bound on the work lost (5 s: 19 steps) wins over Young/Daly's 41 s
    assert choose_interval(0.232, 0.251, 0.05, mtbf_s=3600.0).every == 19
    often = choose_interval(0.232, 0.251, 0.05, mtbf_s=60.0, max_lost_s=1e9)
    assert often.young_daly_every == 21 and often.budget_every == 19
    assert often.every == 16 and often.rule == "young-daly"  # 21, the nearest power of two
    frequent = choose_interval(0.232, 0.251, 0.05, mtbf_s=10.0, max_lost_s=1e9)  # Y/D: 9 steps
    assert frequent.young_daly_every == 9 and frequent.every == 16 and frequent.rule == "budget"
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
    own: float | list[float],
    agent: float | list[float],
    stalled: float = 0.0,
    plain_cpu: float = 0.010,
    agent_idle: float = 0.001,
    wall: float = 0.020,
) -> Calibration:
    """A calibration over steps of ``wall`` seconds (``plain_cpu`` of the rank's CPU each)
    whose five snapshots took ``own`` and ``agent`` CPU seconds beyond that and blocked the
    loop ``stalled`` each; the agent idles at ``agent_idle`` CPU seconds a second."""
    owns = own if isinstance(own, list) else [own] * len(CYCLES)
    agents = agent if isinstance(agent, list) else [agent] * len(CYCLES)
    cycle_of = {o: i for i, cycle in enumerate(CYCLES) for o in cycle}
    calibration = Calibration(0)
    clock = Probe(0.0, 0.0, 0.0, 0.0)
    for o in range(2, DECIDE_AT + 1):
        calibration.probe(o, clock)
        if o == DECIDE_AT:
            break
        calibration.record(o, wall)
        cpu, extra_agent, extra_stall = plain_cpu, 0.0, 0.0
        if o in cycle_of and o == CYCLES[cycle_of[o]][0]:  # the cycle's work, at its start
            cpu += owns[cycle_of[o]]
            extra_agent, extra_stall = agents[cycle_of[o]], stalled
        clock = Probe(
            clock.wall + wall,
            clock.own_cpu + cpu,
            clock.agent_cpu + agent_idle * wall + extra_agent,
            clock.stalled + extra_stall,
        )
    return calibration


def _report(measured: Measured, machine: int = 1, cores: int = 2, node: int = 0) -> RankReport:
    return RankReport(measured, machine, cores, node)


def test_calibration_probes_plain_steps_then_five_snapshots_then_decides() -> None:
    policy = SnapshotPolicy(overhead=0.05, max_lost_s=60.0)
    policy.begin_epoch(start=5, restored_every=None)
    due, quiet = [], []
    for step in range(5, 5 + DECIDE_AT):
        quiet += [step - 5] if policy.quiet_before(step) else []
        assert policy.calibrating() and not policy.ready(step)
        policy.probe(step, Probe(step, 0.01 * step, 0.0, 0.0))
        due.append(policy.due(step))
        policy.record(step, 0.02)
    assert [s - 5 for s, d in zip(range(5, 5 + DECIDE_AT), due, strict=True) if d] == sorted(
        SNAPSHOT_AT
    )
    assert {0, 1, 6, 9, 12, 15, 18} == SNAPSHOT_AT and not set(PLAIN) & SNAPSHOT_AT
    # before the plain steps, and before each cycle after the first: the last one's commit
    assert quiet == [2, 9, 12, 15, 18, 21]
    # decided at a fixed step, the same on every rank (the agreement is a collective)
    policy.probe(5 + DECIDE_AT, Probe(5 + DECIDE_AT, 0.01 * (5 + DECIDE_AT), 0.0, 0.0))
    assert policy.ready(5 + DECIDE_AT)


def test_a_snapshots_work_is_measured_against_the_training_work_of_a_step() -> None:
    # Each snapshot: 2 ms of the rank's CPU and 4 ms of its agent's, against steps of 10 ms
    # of CPU (20 ms wall: the machine is shared). Two such ranks on one node of a machine:
    # 2·2 + 4 = 8 ms of work against 2·10 = 20 ms: 40 % of a step, i.e. 8 ms of its 20.
    measured = _calibrated(0.002, 0.004).costs()
    assert measured.own_cpu_s == pytest.approx(0.002) and measured.agent_cpu_s == pytest.approx(
        0.004
    )
    assert measured.step_s == pytest.approx(0.020) and measured.step_cpu_s == pytest.approx(0.010)
    together = Agreement.of([_report(measured), _report(measured)])
    assert together.snapshot_cost_s == pytest.approx(0.008) and together.step_s == 0.020
    policy = SnapshotPolicy(overhead=0.05, max_lost_s=60.0)
    policy.begin_epoch(start=0, restored_every=None)
    chosen = policy.agree([_report(measured), _report(measured)], 25, speak=True)
    assert chosen.budget_every == 8 and chosen.every == 8  # ⌈0.4 / 0.05⌉, a power of two


def test_the_same_work_on_a_busier_machine_chooses_the_same_interval() -> None:
    # Another job beside it slows every step two-fold, the snapshots' work as much: the
    # wall times move, the work does not, and neither does n (one measured snapshot, read
    # off wall-clock steps, chose 1 to 99 for one job here).
    quiet = _calibrated(0.002, 0.004, wall=0.020).costs()
    busy = _calibrated(0.002, 0.004, wall=0.045, agent_idle=0.0005).costs()
    picks = [
        choose_interval(a.snapshot_cost_s, a.step_s, 0.05).every
        for a in (Agreement.of([_report(m), _report(m)]) for m in (quiet, busy))
    ]
    assert picks == [8, 8]


def test_one_slow_cycle_or_one_odd_rank_does_not_move_the_interval() -> None:
    steady = _calibrated(0.002, 0.004).costs()
    hiccup = _calibrated([0.002, 0.002, 0.030, 0.002, 0.002], [0.004, 0.004, 0.004, 0.05, 0.004])
    got = hiccup.costs()  # the median of the five cycles
    assert (got.own_cpu_s, got.agent_cpu_s) == pytest.approx((steady.own_cpu_s, steady.agent_cpu_s))
    # the agent's work counts once per node, whichever of its ranks read it how
    odd = Measured(0.002, 0.009, 0.0, 0.020, 0.010)
    two = Agreement.of([_report(steady), _report(odd), _report(steady), _report(steady, node=1)])
    assert two.work[1] == pytest.approx((0.002 * 4 + 0.004 + 0.004, 0.040))  # node 0: median
    loud = Measured(0.020, 0.004, 0.0, 0.020, 0.010)
    named = Agreement.of([_report(steady), _report(loud), _report(steady), _report(steady)])
    assert set(named.outliers) == {1}


def test_the_slowest_machine_sets_the_pace_and_blocked_time_adds() -> None:
    light = Measured(0.001, 0.001, 0.0, 0.020, 0.010)
    heavy = Measured(0.004, 0.008, 0.003, 0.020, 0.010)
    together = Agreement.of(
        [_report(light, machine=1), _report(light, machine=1, node=1), _report(heavy, machine=2)]
    )
    # machine 2: 12 ms of work against 10 ms of step: 1.2 × 20 ms; blocked: median 0 ms
    assert together.snapshot_cost_s == pytest.approx(0.024)
    rows = [RankReport(heavy, 5, 16, 3).row()]
    assert RankReport.of_row(rows[0]) == RankReport(heavy, 5, 16, 3)


def test_the_work_a_failure_may_lose_bounds_the_interval() -> None:
    # the budget alone would take 44 steps of 0.36 s (15.8 s of training lost at worst)
    bounded = choose_interval(0.781, 0.360, 0.05, max_lost_s=5.0)
    assert bounded.budget_every == 44 and bounded.every == 13 and bounded.rule == "max-lost"
    assert bounded.every * 0.360 <= 5.0 < (bounded.every + 1) * 0.360
    assert "raise resilient(max_lost=…)" in bounded.describe()
    assert choose_interval(0.781, 0.360, 0.05, max_lost_s=60.0).every == 32  # 44: nearest
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


def test_a_cost_the_wall_clock_shows_clear_of_its_noise_is_not_left_to_the_work() -> None:
    # The work says 8 ms a snapshot; the cycles' steps took 60 ± 5 ms longer than T (a
    # training thread waiting, which no CPU clock sees): the wall's lower bound is taken.
    work = Measured(0.002, 0.004, 0.0, 0.020, 0.010, wall_low_s=0.0)
    seen = Measured(0.002, 0.004, 0.0, 0.020, 0.010, wall_low_s=0.055)
    assert Agreement.of([_report(work), _report(work)]).snapshot_cost_s == pytest.approx(0.008)
    assert Agreement.of([_report(seen), _report(seen)]).snapshot_cost_s == pytest.approx(0.055)
    # from a calibration: five cycles of +60, +55, +65, +58, +62 ms over their three steps
    calibration = _calibrated(0.002, 0.004)
    for cycle, extra in zip(CYCLES, (0.060, 0.055, 0.065, 0.058, 0.062), strict=True):
        calibration.record(cycle[1], 0.020 + extra)
    assert 0.050 < calibration.costs().wall_low_s < 0.060
    noisy = _calibrated(0.002, 0.004)  # ±30 ms of noise around +5 ms: nothing stands clear
    for cycle, extra in zip(CYCLES, (0.035, -0.025, 0.030, -0.020, 0.005), strict=True):
        noisy.record(cycle[1], 0.020 + extra)
    assert noisy.costs().wall_low_s == 0.0


def test_a_line_over_its_budget_says_why() -> None:
    # An acceptance run logged "expected overhead 5.6% (budget 5%)" and nothing more: the
    # budget's 19 steps rounded to the nearest power of two, 16 (by design, at most √2 over).
    over = choose_interval(0.232, 0.251, 0.05, max_lost_s=1e9)
    assert (over.budget_every, over.every, over.rule) == (19, 16, "budget")
    assert over.expected_overhead > 0.05
    line = over.describe()
    assert "expected overhead 5.8% (budget 5%); " not in line  # the why follows at the end
    assert line.endswith(
        "; above the budget: 19 step(s) rounded to the nearest power of two, 16, a cadence "
        "that measurement noise does not change from run to run (at most √2 over); "
        "resilient(every=19) keeps within it"
    )
    young_daly = choose_interval(0.232, 0.251, 0.05, mtbf_s=60.0, max_lost_s=1e9)
    assert "above the budget: 21 step(s) rounded" in young_daly.describe()
    capped = choose_interval(1e6, 0.1, 0.05, max_lost_s=1e9)
    assert f"no interval of up to {MAX_EVERY} steps keeps within it" in capped.describe()
    within = choose_interval(0.011, 0.2, 0.05, max_lost_s=1e9)  # 2 steps: 2.8 %
    assert within.expected_overhead <= 0.05 and "above the budget" not in within.describe()
    bounded = choose_interval(0.781, 0.360, 0.05, max_lost_s=5.0)  # max_lost says it already
    assert "above the budget" not in bounded.describe()


def test_a_line_reads_the_budget_and_the_work_lost_as_they_are() -> None:
    line = choose_interval(0.0105, 0.2, 0.025, max_lost_s=5.0).describe()
    assert "(budget 2.5%)" in line  # it read "(budget 2%)"
    every_step = choose_interval(0.01, 0.2, 0.05, max_lost_s=5.0)
    assert every_step.every == 1 and every_step.expected_lost_s == pytest.approx(0.3)
    # it read "expected work lost per failure 0.30 s, at most 0.20 s"
    assert "0.30 s (1/2 + 1 steps), 1 step(s) between snapshots 0.20 s" in every_step.describe()
