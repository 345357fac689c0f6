"""Which committed steps a durable flush is due at: the multiples of ``every``, or — with
snapshots every n steps, whose commits need not fall on them — the first commit past one;
and not while a failed flush's other writers still write it."""

from __future__ import annotations

from peerckpt.manifest import ChunkRecord
from peerckpt.messages.control import Flushed
from peerckpt.persist.config import PersistConfig
from peerckpt.recovery import flushes
from peerckpt.recovery.flushes import FlushScheduler


def _due(commits: list[int], every: int) -> list[int]:
    scheduler = FlushScheduler(PersistConfig.from_settings("/tmp/x", every, None, None))
    due = []
    for step in commits:
        if scheduler.due(step):
            due.append(step)
            scheduler._last_step = step  # as start() records it
    return due


def test_every_step_commits_flush_on_the_multiples_only() -> None:
    assert _due(list(range(0, 35)), 10) == [0, 10, 20, 30]


def test_spaced_commits_flush_at_the_first_commit_past_each_multiple() -> None:
    assert _due(list(range(0, 400, 35)), 100) == [0, 105, 210, 315]
    assert _due([0, 9, 18, 27, 36], 10) == [0, 18, 27, 36]


def _two_writer_flush(tmp_path, step: int = 10) -> FlushScheduler:
    """A flush of ``step`` whose two chunks are written by nodes 0 and 1 (rank r on node r)."""
    scheduler = FlushScheduler(PersistConfig.from_settings(str(tmp_path), 10, None, None))
    layouts = {
        r: [ChunkRecord(f"w{r}", "float32", (4,), (0,), (4,), 0, 16, scope="rank").to_msg()]
        for r in (0, 1)
    }
    assert scheduler.due(step)
    events = scheduler.start(step, 1, 1, layouts, {0: {0}, 1: {1}})
    assert set(events) == {0, 1}
    return scheduler


def test_a_failed_flush_holds_the_next_until_its_other_writers_report(tmp_path) -> None:
    """Node 0 fails its share (full disk) while node 1 still writes: a flush started now
    would be refused by node 1 as 'still writing an earlier flush', so step 20 is lag, and
    step 30 flushes once node 1 has reported."""
    scheduler = _two_writer_flush(tmp_path)
    scheduler.written(Flushed(0, 10, False, error="No space left on device"))
    assert not scheduler.busy()  # the job may finish: nothing will commit
    assert scheduler.draining() == {1}
    assert not scheduler.due(20)
    assert scheduler.skipped == [20]
    scheduler.written(Flushed(1, 10, True, nbytes=16, seconds=0.1))
    assert scheduler.draining() == set()
    assert scheduler.due(30)


def test_a_lost_writer_of_a_failed_flush_holds_nothing(tmp_path) -> None:
    scheduler = _two_writer_flush(tmp_path)
    scheduler.written(Flushed(1, 10, False, error="slot reused"))
    assert scheduler.draining() == {0}
    scheduler.node_lost(0)
    assert scheduler.draining() == set()
    assert scheduler.due(20)


def test_a_writer_that_never_reports_holds_the_next_flush_for_a_bounded_time(tmp_path) -> None:
    scheduler = _two_writer_flush(tmp_path)
    scheduler.written(Flushed(0, 10, False, error="No space left on device"))
    assert not scheduler.due(20)
    assert scheduler.current is not None and scheduler.current.failed_at is not None
    scheduler.current.failed_at -= flushes.DRAIN_LIMIT_S + 1
    assert scheduler.due(30)


def test_the_last_step_is_owed_unless_a_flush_of_it_was_started(tmp_path) -> None:
    scheduler = _two_writer_flush(tmp_path, step=10)
    assert not scheduler.owed(10) and scheduler.owed(11)


def test_a_job_whose_every_flush_failed_is_told_why(tmp_path) -> None:
    scheduler = _two_writer_flush(tmp_path, step=10)
    # A job ending while its only flush still writes has nothing durable either.
    assert "(the last, of step 10: still writing when the job ended)" in scheduler.failure()
    scheduler.written(Flushed(0, 10, False, error="EIO: Input/output error"))
    scheduler.written(Flushed(1, 10, True, nbytes=16, seconds=0.1))
    why = scheduler.failure()
    assert f"no step was made durable in {tmp_path}: 1 flush(es) tried, none committed" in why
    assert "(the last, of step 10: node 0: EIO: Input/output error)" in why
    assert FlushScheduler(scheduler.config).failure() == ""  # none tried: nothing to say


def test_a_failed_flush_settles_again_once_its_last_writer_reported(tmp_path) -> None:
    """The job's end waits for a failed flush's other writers before it flushes its last
    step (they would refuse it): it hears when they are done."""
    scheduler = _two_writer_flush(tmp_path)
    settled: list[set[int]] = []
    scheduler.on_settled = lambda: settled.append(scheduler.draining())
    scheduler.written(Flushed(0, 10, False, error="No space left on device"))
    assert settled == [{1}]
    scheduler.node_lost(1)
    assert settled == [{1}, set()]
