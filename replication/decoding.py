"""Rebuilding a lost rank's committed snapshot from its group (``--erasure K+M``).

The coordinator marks a rank that no node holds any more but whose stripes keep k pieces
each as held by ``ERASURE`` (``recovery/erasure.py``); the agent that must produce it (the
replacement's, or a resharding reader's) calls ``rebuild``:

1. for each of the rank's k pieces (one per stripe), choose k surviving pieces of that
   stripe: parity rows first (row 0, plain XOR, is the cheapest to decode with), then the
   other data pieces — only what is needed, and only the lost rank's pieces are decoded;
2. pull them in parallel, one connection per piece: parity (``fetch_parity``: its crc32c
   checked, with the stripe's manifests, the lost rank's among them) first, then the data
   pieces of surviving ranks (``fetch_ranges``, from the node the plan says holds each);
3. decode each of the lost rank's pieces (``peerckpt/coding.py``'s ``decode_rows``) straight
   into one of its own slots, and verify every chunk against the rank's own crc32c;
4. a rank coded without its data-parallel chunks (its manifest names them absent:
   ``replication/dedup.py``) has them read from a twin that survives
   (``replication/twinfill.py``: locally, else ``fetch_boxes``), each checked against the
   lost rank's own crc32c. Every piece's byte ranges are its rank's coded ranges
   (``manifest.byte_ranges()``), as the encoder cut them.

A parity whose bytes do not match the crc32c its holder computed is corrupt: refused
(ChecksumMismatch, naming the holder and the stripe), never decoded from. A rebuilt chunk
that fails its own checksum (a surviving data piece was damaged) fails the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from peerckpt.coding import Coding, Group, Stripe, decode_rows, piece_ranges, stripe_of_piece
from peerckpt.errors import ChecksumMismatch, ProtocolError, RecoveryFailed
from peerckpt.gf256 import mad_into
from peerckpt.manifest import SnapshotManifest
from peerckpt.messages.data import FetchParity, FetchRanges, ParityReply
from peerckpt.replication.store import Slot, SlotStore
from peerckpt.replication.twinfill import complete
from peerckpt.states import SlotKind
from peerckpt.wire import Connection

log = logging.getLogger("peerckpt.decoding")


@dataclass(frozen=True)
class Rebuilt:
    """The rebuilt slot and what was pulled: node → bytes."""

    slot: Slot
    pulled: dict[int, int]


def _receive(conn: Connection, nbytes: int) -> tuple[np.ndarray, int | None]:
    """Data frames of ``nbytes`` into a fresh array; the crc32c the ``end`` frame gave."""
    from peerckpt.replication.transfer import recv_bytes

    out = np.empty(nbytes, dtype=np.uint8)
    end = recv_bytes(conn, out.data, nbytes)
    return out, (end.crcs[0] if end.crcs else None)


def _fetch_parity(
    conn: Connection, epoch: int, gen: int, group: Group, stripe: Stripe, row: int, step: int
) -> tuple[np.ndarray, list[SnapshotManifest]]:
    try:
        conn.send_msg(FetchParity(epoch, gen, list(group.ranks), stripe.index, row, step))
        reply = conn.recv_msg(ParityReply)
        data, _ = _receive(conn, reply.length)
    finally:
        conn.close()
    if crc32c.crc32c(data.data) != reply.crc:
        node = group.nodes[(stripe.index + row) % group.size]
        raise ChecksumMismatch(
            f"the parity of stripe {stripe.index} row {row} (step {step}) held by node {node} "
            f"fails its crc32c: it is corrupt and is not decoded from"
        )
    return data, reply.manifests


def _fetch_ranges(
    conn: Connection, epoch: int, gen: int, rank: int, step: int, ranges: list[tuple[int, int]]
) -> np.ndarray:
    try:
        conn.send_msg(FetchRanges(epoch, gen, rank, step, ranges))
        data, crc = _receive(conn, sum(b - a for a, b in ranges))
    finally:
        conn.close()
    if crc is None or crc32c.crc32c(data.data) != crc:
        raise ChecksumMismatch(f"a piece of rank {rank} step {step} arrived damaged")
    return data


def twin_sources(restore: dict[str, Any], rank: int, alive: set[int], node: int) -> list[list[int]]:
    """Where a rebuild of ``rank`` reads the chunks it was coded without: [node, twin rank]
    of each twin still held on a node in ``alive``, this agent's ``node`` first."""
    holders = {int(r): int(n) for r, n in restore.get("holders", {}).items()}
    twins = {int(r): [int(t) for t in ts] for r, ts in restore.get("twins", {}).items()}
    pairs = sorted({(holders[t], t) for t in twins.get(rank, ()) if holders.get(t) in alive})
    best: dict[int, int] = {}
    for n, t in pairs:
        best.setdefault(n, t)  # one twin per node: the smallest
    return [[n, best[n]] for n in sorted(best, key=lambda n: (n != node, n))]


def rebuild(
    store: SlotStore,
    epoch: int,
    gen: int,
    rank: int,
    step: int,
    restore: dict[str, Any],
    alive: set[int],
    connect: Callable[[int], Connection],
    index: int,
    node: int = -1,
) -> Rebuilt:
    """Rebuild ``rank``'s snapshot of ``step`` into its own slot ``index``; verified. Chunks
    it was coded without are read from a data-parallel twin (``twin_sources``; ``node``:
    this agent's, where a twin's copy is read without the network)."""
    if not restore:
        raise RecoveryFailed(f"rank {rank} has no copy and no erasure layout to rebuild from")
    coding = Coding.from_msg(restore["coding"])
    holders = {int(r): int(n) for r, n in restore["holders"].items()}
    group = coding.group_of(rank)
    if group is None or group.k < 1:
        raise RecoveryFailed(f"rank {rank} belongs to no coding group of step {step}")
    pos, g, k, m = group.position(rank), group.size, group.k, group.m
    plans = []  # per piece: stripe, the parity rows and data positions to read
    for p in range(k):
        stripe = stripe_of_piece(g, k, m, pos, p)
        rows = [t for t in range(m) if group.nodes[(stripe.index + t) % g] in alive]
        data = [q for q in stripe.data if q != pos and holders.get(group.ranks[q]) in alive]
        use_rows = rows[: max(1, k - len(data))]
        use_data = data[: k - len(use_rows)]
        if len(use_rows) + len(use_data) < k or not use_rows:
            raise RecoveryFailed(
                f"rank {rank}'s stripe {stripe.index} keeps {len(rows) + len(data)} readable "
                f"piece(s), {k} needed: more than {m} of its group's nodes were lost"
            )
        plans.append((p, stripe, use_rows, use_data))
    pulled: dict[int, int] = {}
    with ThreadPoolExecutor(
        max_workers=min(16, k * k), thread_name_prefix="peerckpt-rebuild"
    ) as pool:
        parity_jobs = {
            (p, t): pool.submit(
                _fetch_parity,
                connect(group.nodes[(stripe.index + t) % g]),
                epoch,
                gen,
                group,
                stripe,
                t,
                step,
            )
            for p, stripe, rows, _ in plans
            for t in rows
        }
        parity = {key: job.result() for key, job in parity_jobs.items()}
        manifests: dict[int, SnapshotManifest] = {}
        for _, got in parity.values():
            manifests.update({man.rank: man for man in got})
        mine = manifests.get(rank)
        if mine is None or mine.step != step:
            raise ProtocolError(f"no parity holder kept rank {rank}'s manifest of step {step}")
        data_jobs = {}
        for p, stripe, _, positions in plans:
            for q in positions:
                other = group.ranks[q]
                man = manifests[other]
                piece = stripe.symbol_at(q)
                assert piece is not None
                ranges = piece_ranges(man.byte_ranges(), k, piece)
                node = holders[other]
                data_jobs[(p, q)] = pool.submit(
                    _fetch_ranges, connect(node), epoch, gen, other, step, ranges
                )
                pulled[node] = pulled.get(node, 0) + sum(b - a for a, b in ranges)
        pieces = {key: job.result() for key, job in data_jobs.items()}
    for (p, t), (arr, _) in parity.items():
        node = group.nodes[(plans[p][1].index + t) % g]
        pulled[node] = pulled.get(node, 0) + arr.size
    slot = store.ensure(SlotKind.OWN, gen, rank, index, mine.used_bytes)
    with slot.lock:
        slot.invalidate()
        view = np.frombuffer(slot.segment.view, dtype=np.uint8)
        for p, stripe, rows, positions in plans:
            symbols = [(k + t, parity[(p, t)][0]) for t in rows]
            symbols += [(int(stripe.symbol_at(q) or 0), pieces[(p, q)]) for q in positions]
            coef = decode_rows(k, m, [s for s, _ in symbols])[p]
            ranges = piece_ranges(mine.byte_ranges(), k, p)
            out = np.zeros(sum(b - a for a, b in ranges), dtype=np.uint8)
            for c, (_, arr) in zip(coef, symbols, strict=True):
                n = min(out.size, arr.size)
                mad_into(out[:n], arr[:n], c)
            at = 0
            for a, b in ranges:
                view[a:b] = out[at : at + b - a]
                at += b - a
        bad = mine.bad_chunks(slot.segment.view)
        if bad:
            raise ChecksumMismatch(
                f"rank {rank} step {step} rebuilt from its group fails its own crc32c in "
                f"{bad[:3]}: a surviving piece was damaged; it is not restored from"
            )
        slot.manifest = mine
    if mine.absent:  # coded without its data-parallel chunks: a twin holds them
        for source, nbytes in complete(
            store, slot, node, epoch, twin_sources(restore, rank, alive, node), connect
        ).items():
            pulled[source] = pulled.get(source, 0) + nbytes
    log.info(
        "rebuilt rank %d step %d from %d piece(s) of its group%s",
        rank,
        step,
        len(parity) + len(pieces),
        f" and {len(mine.absent)} chunk(s) of a data-parallel twin" if mine.absent else "",
    )
    return Rebuilt(slot, pulled)
