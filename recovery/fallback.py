"""The durable tier as the holder of last resort: which stored step a recovery may read.

Pure helpers of ``recovery/epochs.py``; only ``durable_to_restore`` reads storage (the
manifests of committed steps, verified when the job allows an older step).
"""

from __future__ import annotations

import logging
from typing import Any

from peerckpt.errors import CheckpointError, CorruptCheckpoint, NoCheckpoint
from peerckpt.persist.config import PersistConfig
from peerckpt.persist.durable import DurableCheckpoint, DurableStore
from peerckpt.recovery.commits import CommitTracker

log = logging.getLogger("peerckpt.coordinator")


def durable_to_restore(config: PersistConfig) -> DurableCheckpoint:
    """The latest committed step; with ``allow_older``, the latest that verifies."""
    store = DurableStore(config.url)
    if not config.allow_older:
        return store.open()  # damage is found (and named) as the ranks load it
    steps = store.committed_steps()
    for step in reversed(steps):
        try:
            ckpt = store.open(step)
            problems = ckpt.verify()
        except CorruptCheckpoint as exc:  # its manifest is malformed: as damaged
            problems = [str(exc)]
        if not problems:
            return ckpt
        log.warning(
            "step %d in %s is damaged (%s); --allow-older: trying the step before it",
            step,
            config.url,
            problems[0],
        )
    if steps:
        raise CheckpointError(f"every committed step in {config.url} ({steps}) is damaged")
    raise NoCheckpoint(f"no committed checkpoint in {config.url}")


def same_chunks(ckpt: DurableCheckpoint, tracker: CommitTracker) -> bool:
    """Does the durable step hold every rank's chunks as the committed layout describes them?"""
    stored = {r: {_box(c.record.to_msg()) for c in cs} for r, cs in ckpt.manifest.ranks.items()}
    committed = {r: {_box(c) for c in cs} for r, cs in tracker.committed_layouts.items()}
    return stored == committed


def _box(chunk: list[Any]) -> tuple[Any, ...]:
    """(key, offsets, lengths) of a chunk record in its message form."""
    return (chunk[0], tuple(chunk[3]), tuple(chunk[4]))
