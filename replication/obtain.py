"""Obtaining a verified copy of a rank's committed snapshot for a recovery.

The coordinator's plan gives, per rank, source nodes best first. ``obtain_committed`` tries
them in order and returns the first copy whose every chunk matches its crc32c: the agent's
own slot or a local replica (no network), else a fetch from a peer straight into one of the
rank's own slots. A copy that fails verification is marked invalid and never restored from;
the next source is tried. Only when every source failed does it raise RecoveryFailed, naming
each source and why.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from peerckpt.errors import (
    ChecksumMismatch,
    PeerckptError,
    PeerUnavailable,
    RecoveryFailed,
    no_answer,
)
from peerckpt.manifest import SnapshotManifest
from peerckpt.reads import ERASURE
from peerckpt.replication.decoding import rebuild
from peerckpt.replication.dedup import sent_bytes
from peerckpt.replication.devicepull import DevicePulls
from peerckpt.replication.store import Slot, SlotStore
from peerckpt.replication.transfer import fetch
from peerckpt.replication.twinfill import complete
from peerckpt.states import SlotKind
from peerckpt.wire import Connection

log = logging.getLogger("peerckpt.restore")


@dataclass(frozen=True)
class Obtained:
    """Where a rank's committed snapshot now is, and where it came from."""

    slot: Slot
    manifest: SnapshotManifest
    source: int
    nbytes: int
    seconds: float


def obtain_committed(
    store: SlotStore,
    node: int,
    epoch: int,
    gen: int,
    rank: int,
    step: int,
    sources: list[int],
    connect: Callable[[int], Connection],
    twins: list[list[int]] | None = None,
    erasure: dict[str, Any] | None = None,
    alive: set[int] | None = None,
    device: DevicePulls | None = None,
) -> Obtained:
    """Make ``rank``'s snapshot of ``step`` (layout ``gen``) available, verified, in one of
    its own slots. A source's copy lacking the data-parallel chunks is completed from the
    first of ``twins`` ([node, twin rank] pairs) that has them (``replication/twinfill.py``).
    The source ``ERASURE`` rebuilds it from its coding group (``erasure``: the membership's
    ``erasure_restore``; ``alive``: the nodes of the epoch; ``replication/decoding.py``). A
    peer's copy comes over NCCL where ``device`` and the peer can (``--transport``;
    ``replication/devicepull.py``), else over TCP."""
    failures = []
    unreachable = False  # some source's node did not answer (it may be dying)
    for source in sources:
        start = time.monotonic()
        try:
            if source == ERASURE:
                index = _pull_target(store, gen, rank, step)
                got = rebuild(
                    store,
                    epoch,
                    gen,
                    rank,
                    step,
                    erasure or {},
                    alive or set(),
                    connect,
                    index,
                    node=node,
                )
                slot, nbytes = got.slot, sum(got.pulled.values())
            elif source == node:
                slot, nbytes = _local_copy(store, gen, rank, step), 0
            else:
                slot = _pull(
                    store, epoch, gen, rank, step, functools.partial(connect, source), device
                )
                nbytes = sent_bytes(slot.manifest) if slot.manifest else 0
            if slot.manifest is not None and slot.manifest.absent:
                nbytes += sum(complete(store, slot, node, epoch, twins or [], connect).values())
        except PeerckptError as exc:
            log.error("cannot restore rank %d step %d from node %d: %s", rank, step, source, exc)
            failures.append(f"node {source}: {exc}")
            unreachable |= no_answer(exc)
            continue
        except Exception as exc:  # a bad manifest or a reset mid-frame: try the next source
            log.exception("cannot restore rank %d step %d from node %d", rank, step, source)
            failures.append(f"node {source}: {type(exc).__name__}: {exc}")
            unreachable |= no_answer(exc)
            continue
        assert slot.manifest is not None
        return Obtained(slot, slot.manifest, source, nbytes, time.monotonic() - start)
    raise RecoveryFailed(
        f"no valid copy of rank {rank} step {step} could be read: " + "; ".join(failures),
        unreachable=unreachable,
    )


def _local_copy(store: SlotStore, gen: int, rank: int, step: int) -> Slot:
    slot = store.find(gen, rank, step, partial=True)
    if slot is None:
        raise PeerUnavailable(f"this node holds no copy of rank {rank} step {step}")
    with slot.lock:
        manifest = slot.manifest
        if manifest is None or manifest.step != step:
            raise PeerUnavailable(f"the copy of rank {rank} step {step} was replaced meanwhile")
        bad = manifest.bad_chunks(slot.segment.view)
        if bad:
            slot.invalidate()
            raise ChecksumMismatch(
                f"the local copy of rank {rank} step {step} fails its checksum in {bad[:3]}; "
                "it is not restored from"
            )
    if slot.kind is SlotKind.REPLICA:
        slot = store.adopt(slot, slot.index)
    return slot


def _pull_target(store: SlotStore, gen: int, rank: int, step: int) -> int:
    """Which own slot a pulled copy of ``step`` goes into.

    A slot that already holds (a copy of) this step is overwritten, so that the rank never
    ends up with the same step in both slots: a recovery superseded after its pull pulls
    again, and the snapshot engine relies on exactly one slot holding the committed step.
    Otherwise an empty slot, otherwise slot 0.
    """
    own = [store.get(SlotKind.OWN, gen, rank, index) for index in (0, 1)]
    for index, slot in enumerate(own):
        if slot is not None and slot.step == step:
            return index
    if own[0] is not None and own[0].manifest is not None:
        return 1
    return 0


def _pull(
    store: SlotStore,
    epoch: int,
    gen: int,
    rank: int,
    step: int,
    connect: Callable[[], Connection],
    device: DevicePulls | None = None,
) -> Slot:
    index = _pull_target(store, gen, rank, step)
    holder: list[Slot] = []

    def allocate(manifest: SnapshotManifest) -> memoryview:
        # Called again for a TCP pull after a device pull failed: the slot stays locked.
        if holder:
            if manifest.used_bytes > holder[0].segment.size:
                raise ValueError(f"rank {rank} step {step} grew between two pulls")
        else:
            slot = store.ensure(SlotKind.OWN, gen, rank, index, manifest.used_bytes)
            slot.lock.acquire()
            holder.append(slot)
        holder[0].invalidate()
        return holder[0].segment.view

    conn: Connection | None = None
    try:
        if device is not None:
            manifest, _ = device.pull(connect, epoch, gen, rank, step, allocate)
        else:
            conn = connect()
            manifest = fetch(conn, epoch, gen, rank, step, allocate)
        holder[0].manifest = manifest
        return holder[0]
    finally:
        if holder:
            holder[0].lock.release()
        if conn is not None:
            conn.close()
