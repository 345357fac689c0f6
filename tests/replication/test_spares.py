"""Slots kept ready for spares: made in the background once sizes are known, handed to the
first slot of at most their size, never to a much smaller one, and removed with the arena."""

from __future__ import annotations

import glob
import os

from peerckpt.replication.arena import Arena
from peerckpt.replication.spares import SpareSlots, slot_capacity
from peerckpt.replication.store import SlotStore
from peerckpt.states import SlotKind

MIB = 1 << 20


def test_a_kept_segment_becomes_the_first_slot_that_fits(job) -> None:
    arena = Arena(job[0], 0)
    try:
        spares = SpareSlots(arena, lambda: 2)
        spares.ready(4 * MIB)
        spares.wait()
        assert arena.pooled_at_least(slot_capacity(4 * MIB)) == 2
        kept = {p for p in glob.glob(f"/dev/shm/{arena.prefix}pool-*")}
        assert len(kept) == 2
        store = SlotStore(arena)
        small = store.ensure(SlotKind.OWN, 0, 5, 0, MIB)  # a quarter: not given a kept one
        assert small.segment.path not in kept
        slot = store.ensure(SlotKind.OWN, 0, 3, 0, 4 * MIB)
        assert slot.segment.path in kept and slot.segment.size >= 4 * MIB
        assert arena.pooled_at_least(1) == 1
        store.release_where(lambda s: s is slot)
        assert not os.path.exists(slot.segment.path)
        spares = SpareSlots(arena, lambda: 1)
        spares.ready(4 * MIB)  # one spare left, one kept: nothing more is made
        spares.wait()
        assert arena.pooled_at_least(1) == 1
    finally:
        arena.destroy()
    assert glob.glob(f"/dev/shm/{arena.prefix}*") == []


def test_nothing_is_kept_before_a_size_is_known_or_without_spares(job) -> None:
    arena = Arena(job[0], 0)
    try:
        SpareSlots(arena, lambda: 3).ready(0)
        idle = SpareSlots(arena, lambda: 0)
        idle.ready(MIB)
        idle.wait()
        assert arena.pooled_at_least(1) == 0
    finally:
        arena.destroy()
