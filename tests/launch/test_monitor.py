"""What the launcher's ``JobMonitor`` keeps of a job across coordinators: every failure any
status showed, each in its newest version."""

from __future__ import annotations

from dataclasses import replace

from peerckpt.launch.monitor import JobMonitor
from peerckpt.states import RecoveryKind
from tests.launch.campaign_run import complete
from tests.launch.observed import event, status


def test_a_failure_seen_before_the_coordinator_restarted_is_kept() -> None:
    """The real campaign's three failures: the first two seen from the first coordinator (the
    second one still recovering when last polled), then the coordinator killed; the restarted
    one knows only the third. A stale status (the one that started a new spare node's agent,
    polled before the second failure) arrives after; nothing is lost or rolled back."""
    first, second, third = complete()
    monitor = JobMonitor()
    monitor.observe(status(events=[first]), [first], [])
    recovering = replace(second, resumed_at=None, pulls=[])
    monitor.observe(status(events=[first, recovering]), [first, recovering], [])
    assert monitor.remember([first, second]) == [first, second]
    assert monitor.remember([replace(first, resumed_at=None)]) == [first, second]  # stale
    monitor.observe(status(events=[third]), [third], [])
    assert monitor.events() == [first, second, third]
    assert monitor.summary()["faults"] == 3
    view = monitor.view()
    assert view is not None and len(view.recoveries) == 3


def test_a_recovery_that_restarted_a_survivor_replaces_its_earlier_version() -> None:
    """A survivor restarted in place starts the recovery's restores again (no pulls yet) in
    a newer epoch: that version is newer than the one with the aborted epoch's pulls."""
    started = event(RecoveryKind.RANK, ranks=[1], detected_at=5.0, epoch=2, pulls=[])
    pulled = replace(started, pulls=complete()[0].pulls)
    again = replace(pulled, epoch=3, pulls=[], restarted={0: 6.0})
    monitor = JobMonitor()
    assert monitor.remember([started]) == [started]
    assert monitor.remember([pulled]) == [pulled]
    assert monitor.remember([again]) == [again]
    assert monitor.remember([pulled]) == [again]
