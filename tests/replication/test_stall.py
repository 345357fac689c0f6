"""Which ranks' steps stopped moving, and which of them are stuck (``replication/stall.py``)."""

from __future__ import annotations

from peerckpt.replication.stall import AGAIN_S, STALL_STEPS, StallWatch

PID = 100


class _Cpu:
    """The CPU time of each pid's main thread, as the test sets it."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def __call__(self, pid: int) -> float | None:
        return self.seconds.get(pid)


def _stepping(watch: StallWatch, steps: int, step_s: float, pid: int = PID) -> float:
    """``steps`` steps of ``step_s`` each, seen at each step; returns the time of the last."""
    now = 0.0
    for step in range(steps):
        now = step * step_s
        watch.observe(now, [(pid, 1, step)])
        assert watch.due(now, lambda pid: False) == []
    return now


def test_a_stall_is_named_after_the_floor_or_thirty_usual_steps_then_every_ten_minutes() -> None:
    watch = StallWatch(_Cpu(), warn_min_s=120.0)
    last = _stepping(watch, 10, step_s=2.0)
    assert watch.warn_after(PID) == max(120.0, STALL_STEPS * 2.0)  # 60 s of steps: the floor
    watch.observe(last + 119.0, [(PID, 1, 9)])
    assert watch.due(last + 119.0, lambda pid: False) == []
    [stalled] = watch.due(last + 121.0, lambda pid: False)
    assert (stalled.rank, stalled.step, stalled.step_s, stalled.fence) == (1, 9, 2.0, False)
    assert "has been at step 9 for 121 s, a step usually takes 2 s" in stalled.line()
    assert "uses no CPU" in stalled.line()
    assert watch.due(last + 122.0, lambda pid: False) == []  # named once ...
    assert len(watch.due(last + 121.0 + AGAIN_S, lambda pid: False)) == 1  # ... then again
    slow = StallWatch(_Cpu(), warn_min_s=120.0)
    last = _stepping(slow, 10, step_s=10.0)
    assert slow.warn_after(PID) == STALL_STEPS * 10.0  # slow steps: thirty of them


def test_a_step_that_moves_ends_the_stall_and_a_restore_starts_afresh() -> None:
    watch = StallWatch(_Cpu(), warn_min_s=10.0)
    _stepping(watch, 5, step_s=0.1)
    watch.observe(20.0, [(PID, 1, 4)])
    assert len(watch.due(20.0, lambda pid: False)) == 1
    watch.observe(21.0, [(PID, 1, 5)])  # it moved
    assert watch.due(25.0, lambda pid: False) == []
    watch.observe(26.0, [(PID, 1, 2)])  # restored to an older step: a new count
    assert watch.due(35.0, lambda pid: False) == []
    assert len(watch.due(36.5, lambda pid: False)) == 1
    watch.observe(37.0, [(PID, None, None)])  # out of its loop (an epoch ended): forgotten
    assert watch.due(100.0, lambda pid: False) == []


def test_past_the_stall_timeout_only_a_stuck_rank_is_fenced() -> None:
    cpu = _Cpu()
    watch = StallWatch(cpu, fence_after_s=5.0, warn_min_s=120.0)
    stuck, waiting, computing = 1, 2, 3
    for step in range(3):
        watch.observe(step * 0.1, [(p, p, step) for p in (stuck, waiting, computing)])
    for pid in (stuck, waiting, computing):
        cpu.seconds[pid] = 1.0
    found = []
    for tick in range(1, 80):  # every 0.1 s up to 8 s; the computing one uses half a core
        now = 0.2 + tick * 0.1
        cpu.seconds[computing] = 1.0 + 0.05 * tick
        found += [(now, s) for s in watch.due(now, lambda pid: pid == waiting)]
    # Fenced once, past 5 s; the waiting and computing ones are left for their warning.
    assert [(s.pid, s.fence) for _, s in found] == [(stuck, True)], found
    assert found[0][0] >= 0.2 + 5.0
    cpu.seconds[computing] += 100.0  # it still computes
    later = {s.pid: s for s in watch.due(125.0, lambda pid: pid == waiting)}
    assert set(later) == {waiting, computing}
    assert "waits in a collective" in later[waiting].line()
    assert "computes (" in later[computing].line()
    assert not later[waiting].fence and not later[computing].fence


def test_a_rank_whose_cpu_share_is_not_known_yet_is_not_fenced() -> None:
    """The agent's heartbeat thread may first look at a stalled rank only at the fence
    time (its tick delayed by a slow call to the coordinator): one CPU sample says nothing
    of a share, and a rank computing at full speed was fenced as stuck."""
    cpu = _Cpu()
    watch = StallWatch(cpu, fence_after_s=5.0, warn_min_s=120.0)
    for step in range(3):
        watch.observe(step * 0.1, [(PID, 1, step)])
    cpu.seconds[PID] = 10.0
    assert watch.due(5.5, lambda pid: False) == []  # first look: one sample, share unknown
    cpu.seconds[PID] = 10.0 + 0.9  # it computes: 90 % of a core over the next second
    assert watch.due(6.5, lambda pid: False) == []
    assert watch.due(7.0, lambda pid: False) == []  # not stuck: named at the warning only
    stuck = StallWatch(cpu, fence_after_s=5.0, warn_min_s=120.0)
    for step in range(3):
        stuck.observe(step * 0.1, [(PID, 1, step)])
    assert stuck.due(5.5, lambda pid: False) == []
    [fenced] = stuck.due(6.6, lambda pid: False)  # a second of no CPU: stuck
    assert fenced.fence


def test_before_its_first_step_is_done_a_rank_is_fenced_no_sooner_than_it_is_named() -> None:
    """A loop's first step pays for a compile, its workers' start, a restored loader catching
    up: --stall-timeout counts only once a step has been seen done in the loop."""
    cpu = _Cpu()
    cpu.seconds[PID] = 1.0
    watch = StallWatch(cpu, fence_after_s=5.0, warn_min_s=60.0)
    watch.observe(0.0, [(PID, 1, 0)])
    found = [s for t in range(1, 600) for s in watch.due(t * 0.1, lambda pid: False)]
    assert found == []  # 60 s: neither named nor fenced
    [stalled] = watch.due(60.5, lambda pid: False)
    assert stalled.fence and stalled.step_s is None
