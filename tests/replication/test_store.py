"""The agent's slot store: one segment per slot, whoever asks for it at the same time."""

from __future__ import annotations

import glob
import os
import threading
import time
from typing import Any

from peerckpt.replication.arena import Arena, Segment
from peerckpt.replication.store import Slot, SlotStore
from peerckpt.shm import SHM_DIR
from peerckpt.states import SlotKind


def test_two_threads_ensuring_one_slot_get_the_same_live_segment(job, monkeypatch) -> None:
    """A superseded recovery's pull and the next one's ensure the same own slot at once: both
    must get one segment that still exists (before, the later registration unlinked the
    segment the other thread had returned, and its rank failed to map the path)."""
    name, _ = job
    arena = Arena(name, node=2)
    create = arena.create

    def slow_create(tag: str, size: int, what: str, touch: bool = True, **kw: Any) -> Segment:
        segment = create(tag, size, what, touch, **kw)
        time.sleep(0.2)  # widen the window between creating and registering the segment
        return segment

    monkeypatch.setattr(arena, "create", slow_create)
    store = SlotStore(arena)
    got: list[Slot] = []
    threads = [
        threading.Thread(target=lambda: got.append(store.ensure(SlotKind.OWN, 0, 3, 0, 4096)))
        for _ in range(2)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert len(got) == 2 and got[0] is got[1]
        assert os.path.exists(got[0].segment.path)
        assert glob.glob(os.path.join(SHM_DIR, arena.prefix + "*")) == [got[0].segment.path]
    finally:
        arena.destroy()


def test_a_larger_request_replaces_the_segment_and_unlinks_the_old_one(job) -> None:
    name, _ = job
    arena = Arena(name, node=1)
    store = SlotStore(arena)
    try:
        small = store.ensure(SlotKind.REPLICA, 0, 1, 1, 4096)
        assert store.ensure(SlotKind.REPLICA, 0, 1, 1, 1024) is small
        large = store.ensure(SlotKind.REPLICA, 0, 1, 1, 1 << 20)
        assert large is not small and large.segment.size >= 1 << 20
        assert not os.path.exists(small.segment.path) and os.path.exists(large.segment.path)
    finally:
        arena.destroy()


def _held_bytes(segment: Segment) -> int:
    return os.stat(segment.path).st_blocks * 512


def test_a_partial_copy_reserves_only_the_ranges_it_holds_until_a_whole_push(job) -> None:
    """Redundancy-aware replication saves the buddies' memory: a replica slot for a copy
    without its data-parallel chunks holds memory for the chunks it gets only."""
    name, _ = job
    arena = Arena(name, node=1)
    store = SlotStore(arena)
    mib = 1 << 20
    try:
        slot = store.ensure(SlotKind.REPLICA, 0, 3, 0, 8 * mib, only=[(0, mib)])
        assert slot.segment.sparse and _held_bytes(slot.segment) == mib
        slot.segment.view[:mib] = b"x" * mib  # written where reserved: nothing more held
        assert _held_bytes(slot.segment) == mib
        # the next partial push into the same slot reserves nothing new
        assert store.ensure(SlotKind.REPLICA, 0, 3, 0, 8 * mib, only=[(0, mib)]) is slot
        assert _held_bytes(slot.segment) == mib
        # a whole push (the coordinator asked for it) reserves the rest before it lands
        assert store.ensure(SlotKind.REPLICA, 0, 3, 0, 8 * mib) is slot
        assert not slot.segment.sparse and _held_bytes(slot.segment) == 8 * mib
    finally:
        arena.destroy()
