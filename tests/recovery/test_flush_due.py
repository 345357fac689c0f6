"""Which committed steps a durable flush is due at: the multiples of ``every``, or — with
snapshots every n steps, whose commits need not fall on them — the first commit past one."""

from __future__ import annotations

from peerckpt.persist.config import PersistConfig
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
