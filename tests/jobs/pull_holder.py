"""One recovery pull between two agents' data planes on this machine, for the GPU test of the
NCCL pull (``tests/gpu/test_nccl_pull.py``) and its benchmark (``bench/gpu.py --nccl``).

The holder runs as a process of its own (NCCL wants each end in its own process)::

    PEERCKPT_SECRET=HEX python pull_holder.py --job NAME --mib N [--corrupt-piece K]

It writes a snapshot of N MiB (chunks of several dtypes, bytes from a fixed seed) into rank
0's own slot of node 0, serves its data plane with pulls over NCCL, prints ``READY ADDRESS``
and runs until its stdin closes. ``--corrupt-piece K`` flips a byte of the K-th piece it sends
over NCCL, on the way (its slot stays intact). ``pull`` (imported) is the puller's side.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

import numpy as np

from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.replication import nccl
from peerckpt.replication.arena import Arena
from peerckpt.replication.devicepull import DevicePulls
from peerckpt.replication.store import Slot, SlotStore
from peerckpt.replication.transfer import DataServer
from peerckpt.replication.transport import DeviceFabric, TransportMode
from peerckpt.states import SlotKind
from peerckpt.wire import connect_tcp

DTYPES = [("float32", 4), ("bfloat16", 2), ("int64", 8), ("uint8", 1)]
RANK, STEP = 0, 5


@functools.lru_cache(maxsize=1)
def snapshot_bytes(mib: int) -> tuple[bytes, tuple[ChunkRecord, ...], int]:
    """The holder's snapshot of ``mib`` MiB: its bytes, chunks and used size."""
    total = mib << 20
    chunks, off, i = [], 0, 0
    while off < total - 4096:
        dtype, width = DTYPES[i % len(DTYPES)]
        count = min((total - off) // width, (total // 7 + 12345 * i) // width)
        chunks.append(ChunkRecord(f"t{i}", dtype, (count,), (0,), (count,), off, count * width))
        off = (off + count * width + 63) // 64 * 64
        i += 1
    data = np.random.default_rng(29).integers(0, 256, off, dtype=np.uint8).tobytes()
    return data, tuple(chunks), off


class _Corrupting:
    """A fabric whose links flip a byte of the ``piece``-th piece they send."""

    def __init__(self, inner: DeviceFabric, piece: int) -> None:
        self.inner, self.piece, self.name = inner, piece, inner.name

    def unique_id(self) -> bytes:
        return self.inner.unique_id()

    def open(self, uid: bytes, rank: int, device: int, nbytes: int) -> Any:
        link = self.inner.open(uid, rank, device, nbytes)
        put, count = link.put, [0]

        def corrupt_put(buf: int, piece: memoryview) -> None:
            if count[0] == self.piece:
                damaged = bytearray(piece)
                damaged[len(damaged) // 2] ^= 0x20
                piece = memoryview(damaged)
            count[0] += 1
            put(buf, piece)

        link.put = corrupt_put  # type: ignore[method-assign, unused-ignore]
        return link


def _probe(corrupt: int | None) -> Any:
    def probe() -> tuple[DeviceFabric | None, str]:
        fabric, why = nccl.probe()
        if fabric is not None and corrupt is not None:
            fabric = _Corrupting(fabric, corrupt)
        return fabric, why

    return probe


def pull(
    job: str, secret: bytes, address: str, mode: TransportMode, mib: int
) -> tuple[str, float, bool]:
    """Pull the holder's snapshot into node 1's slot: the transport that carried it, the
    seconds the pull took and whether the bytes equal the holder's."""
    arena = Arena(job, 1)
    try:
        store = SlotStore(arena)
        got: list[Slot] = []

        def allocate(manifest: SnapshotManifest) -> memoryview:
            if not got:
                got.append(store.ensure(SlotKind.OWN, 0, RANK, 0, manifest.used_bytes))
            got[0].invalidate()
            return got[0].segment.view

        pulls = DevicePulls(mode, nccl.probe, node=1)
        pulls.fabric()  # probed before the clock starts, as an agent does when it starts
        start = time.perf_counter()
        manifest, how = pulls.pull(
            lambda: connect_tcp(address, secret, job, io_timeout=120.0),
            1,
            0,
            RANK,
            STEP,
            allocate,
        )
        took = time.perf_counter() - start
        expected, _, used = snapshot_bytes(mib)
        same = manifest.used_bytes == used and bytes(got[0].segment.view[:used]) == expected
        return how, took, same
    finally:
        arena.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--corrupt-piece", type=int, default=None)
    args = parser.parse_args()
    secret = bytes.fromhex(os.environ["PEERCKPT_SECRET"])
    arena = Arena(args.job, 0)
    try:
        store = SlotStore(arena)
        data, chunks, used = snapshot_bytes(args.mib)
        slot = store.ensure(SlotKind.OWN, 0, RANK, 0, used)
        slot.segment.view[:used] = data
        manifest = SnapshotManifest(RANK, STEP, 0, chunks, used)
        slot.manifest = manifest.with_checksums(slot.segment.view)
        device = DevicePulls(TransportMode.NCCL, _probe(args.corrupt_piece), node=0)
        server = DataServer(store, secret, args.job, lambda: 1, lambda: STEP, device=device)
        server.start()
        device.fabric()
        print(f"READY {server.address}", flush=True)
        sys.stdin.read()  # until the test or benchmark closes it
        server.stop()
    finally:
        arena.destroy()


if __name__ == "__main__":
    main()
