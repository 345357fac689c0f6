"""The agent's slots: ping-pong snapshot slots of its own ranks and the replicas it keeps.

Every rank has two *own* slots (index 0 and 1) on its node; the rank alternates between them
so the last committed snapshot is never overwritten before a newer one is committed. A buddy
keeps two *replica* slots per rank it mirrors. A slot is readable (sent, restored from) only
while its ``manifest`` is set: the bytes are complete and their checksums known.

Slots are keyed by layout *generation* too: when the job's topology changes, the new ranks'
snapshots go to new slots while the old layout's committed copies stay readable, until the
new layout has committed a step of its own.

Each slot has a lock, held while its bytes are being sent or received, so an epoch change can
wait for in-flight transfers before handing a slot back to a rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from peerckpt.manifest import SnapshotManifest
from peerckpt.replication.arena import Arena, Segment
from peerckpt.replication.checksums import RunningChecksums
from peerckpt.states import SlotKind


@dataclass
class Slot:
    """One snapshot slot (own) or replica slot, with what it currently holds."""

    rank: int
    index: int
    kind: SlotKind
    segment: Segment
    gen: int = 0
    manifest: SnapshotManifest | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The checksums of the bytes just written, still being computed while they are pushed
    # (``replicator.ReplicationJob.start``); ``manifest`` is set once a push sent them.
    pending: RunningChecksums | None = None

    @property
    def step(self) -> int | None:
        return self.manifest.step if self.manifest is not None else None

    def invalidate(self) -> None:
        """Forget what the slot held (its bytes are about to change)."""
        self.manifest = None
        if self.pending is not None:
            self.pending.cancel()  # stop reading the old bytes before they change
            self.pending = None


class SlotStore:
    """All slots of one agent, keyed by (kind, generation, rank, index)."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self._slots: dict[tuple[SlotKind, int, int, int], Slot] = {}
        self._lock = threading.Lock()
        # One lock per slot key, held while that slot is (re)allocated: two threads ensuring
        # the same slot at once (a superseded recovery's pull and the next one's) must not
        # each create a segment, the later registration unlinking the one the other returned.
        self._creating: dict[tuple[SlotKind, int, int, int], threading.Lock] = {}

    def get(self, kind: SlotKind, gen: int, rank: int, index: int) -> Slot | None:
        with self._lock:
            return self._slots.get((kind, gen, rank, index))

    def ensure(
        self,
        kind: SlotKind,
        gen: int,
        rank: int,
        index: int,
        nbytes: int,
        touch: bool = True,
        only: list[tuple[int, int]] | None = None,
    ) -> Slot:
        """Return the slot, (re)allocated so that it holds at least ``nbytes``, with the
        memory of the byte ranges ``only`` (start, end; None: all) reserved for writing.

        A reallocated slot is a new segment (new file name); the old one is unlinked.
        """
        key = (kind, gen, rank, index)
        what = f"{kind.value} slot {index} of rank {rank} (layout {gen})"
        with self._lock:
            creating = self._creating.setdefault(key, threading.Lock())
        with creating:
            with self._lock:
                slot = self._slots.get(key)
            if slot is not None and slot.segment.size >= nbytes:
                if slot.segment.sparse:  # a partial copy's holes: reserve what comes now
                    slot.segment.reserve(only if only is not None else [(0, nbytes)], what)
                    slot.segment.sparse = only is not None or nbytes < slot.segment.size
                return slot
            tag = f"{kind.value[0]}{rank}-g{gen}-{index}"
            segment = self.arena.create(tag, nbytes, what, touch, only=only)
            new = Slot(rank, index, kind, segment, gen=gen)
            with self._lock:
                old = self._slots.get(key)
                self._slots[key] = new
        if old is not None:
            with old.lock:
                old.invalidate()
                self.arena.release(old.segment)
        return new

    def replica_target(self, gen: int, rank: int, keep_step: int | None) -> int:
        """Which replica slot of ``rank`` a new push may overwrite.

        Never the one holding ``keep_step`` (the committed step); else an empty slot, else the
        older one. The receiver decides, not the sender: after a recovery the sender's slot
        numbering restarts, and its index may name the buddy's only committed copy.
        """
        held = [self.get(SlotKind.REPLICA, gen, rank, i) for i in (0, 1)]
        steps = [s.step if s is not None else None for s in held]
        if keep_step is not None and keep_step in steps:
            return 1 - steps.index(keep_step)
        if None in steps:
            return steps.index(None)
        return 0 if steps[0] <= steps[1] else 1  # type: ignore[operator]

    def find(self, gen: int, rank: int, step: int, partial: bool = False) -> Slot | None:
        """A complete copy of ``rank``'s snapshot of ``step`` in layout ``gen``: own slots first.

        ``partial``: a copy lacking its data-parallel chunks (``replication/dedup.py``) will
        do too (one that is complete still comes first)."""
        with self._lock:
            slots = sorted(
                self._slots.values(), key=lambda s: (s.kind is not SlotKind.OWN, s.index)
            )
        found = [
            slot
            for slot in slots
            if slot.kind is not SlotKind.STAGING
            and slot.gen == gen
            and slot.rank == rank
            and slot.step == step
        ]
        for slot in found:
            manifest = slot.manifest
            if manifest is not None and not manifest.absent:
                return slot
        if partial:
            return next(iter(found), None)
        return None

    def adopt(self, slot: Slot, index: int) -> Slot:
        """Turn a replica slot into own slot ``index`` of its rank (a local restore source)."""
        with self._lock:
            self._slots.pop((slot.kind, slot.gen, slot.rank, slot.index), None)
            old = self._slots.pop((SlotKind.OWN, slot.gen, slot.rank, index), None)
            adopted = Slot(
                slot.rank, index, SlotKind.OWN, slot.segment, gen=slot.gen, manifest=slot.manifest
            )
            self._slots[(SlotKind.OWN, slot.gen, slot.rank, index)] = adopted
        # Whoever still holds the replaced objects (a flush reading them) must see that they
        # are gone: the adopted bytes belong to the new slot and its lock from now on.
        with slot.lock:
            slot.manifest = None
        if old is not None:
            with old.lock:
                old.invalidate()
                self.arena.release(old.segment)
        return adopted

    def release_where(self, doomed: Callable[[Slot], bool]) -> list[Slot]:
        """Release every slot for which ``doomed`` is true; return them."""
        with self._lock:
            victims = [s for s in self._slots.values() if doomed(s)]
            for s in victims:
                del self._slots[(s.kind, s.gen, s.rank, s.index)]
        for s in victims:
            with s.lock:
                s.invalidate()
                self.arena.release(s.segment)
        return victims

    def all(self) -> list[Slot]:
        with self._lock:
            return list(self._slots.values())
