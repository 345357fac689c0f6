"""Redundancy-aware replication, the agent's side: which chunks a push leaves out.

A rank declares the chunks of its snapshot that every data-parallel rank holds equal
(``manifest.extra["twins"]``, ``runtime/twins.py``). When the ranks of the epoch live on at
least 1 + k nodes (k: the rank's buddies), those chunks already exist in enough failure
domains without any push: each twin's own slot holds them. So the push to the buddies
carries only the rest (the *extras*: RNG and loader state in the blob, buffers, private
state), and the buddy's copy is a *partial* one: its manifest lists every chunk with its
checksum and names the chunks it lacks (``manifest.extra["absent"]``).

The agent only assumes the twins are equal; the coordinator verifies it at every commit from
the digests of the declared chunks' checksums (``twin_digest``) that every report carries,
and asks for a full push of a rank whose twins differ (``recovery/twins.py``,
``ReplicateWhole``). From then on that rank is pushed whole for the rest of the epoch.

With ``--erasure K+M`` the same chunks are left out of the rank's *coded* bytes
(``coded_absent``): its pieces are cut from the rest, and its parity holders keep its
manifest with those chunks named absent, which a rebuild decodes around and then fills from
a twin (``replication/decoding.py``).

Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib

from peerckpt.coding import Coding
from peerckpt.manifest import SnapshotManifest
from peerckpt.membership import Membership


def declared(manifest: SnapshotManifest) -> tuple[int, ...]:
    """The chunk indices the rank declared data-parallel (none when it opted out)."""
    return tuple(manifest.extra.get("twins", ()))


def absent_chunks(manifest: SnapshotManifest, members: Membership, rank: int) -> tuple[int, ...]:
    """The chunks the push of ``rank``'s snapshot may leave out: its declared ones, when the
    epoch's ranks span at least 1 + (its buddies) nodes; else none."""
    twins = declared(manifest)
    buddies = members.placement.get(rank, [])
    if not twins or not buddies:
        return ()
    domains = {a.node for a in members.ranks.values()}
    if len(domains) < 1 + len(buddies):
        return ()
    return tuple(i for i in twins if manifest.chunks[i].nbytes)


def coded_absent(manifest: SnapshotManifest, coding: Coding, rank: int) -> tuple[int, ...]:
    """``--erasure``: the chunks the coding of ``rank``'s snapshot may leave out: its declared
    ones when its group is protected (k ≥ 1); else none. The twins the agent assumes (every
    declaring rank of the epoch, one per node at least) then span a protected group's K + M
    nodes, more than its parity survives losing; the coordinator checks the twins it really
    has at commit (``recovery/twins.py``) and has a rank that falls short coded whole."""
    twins = declared(manifest)
    group = coding.group_of(rank)
    if not twins or group is None or group.k < 1:
        return ()
    return tuple(i for i in twins if manifest.chunks[i].nbytes)


def twin_digest(manifest: SnapshotManifest) -> str:
    """A digest of the declared chunks (their keys, boxes and crc32c): equal on two ranks
    exactly when their declared chunks are bit-equal (up to crc32c). Empty when none is
    declared. ``manifest`` must carry its checksums."""
    twins = declared(manifest)
    if not twins:
        return ""
    h = hashlib.blake2b(digest_size=12)
    for i in twins:
        c = manifest.chunks[i]
        h.update(repr((c.key, c.dtype, c.offsets, c.lengths, c.nbytes, c.crc)).encode())
    return h.hexdigest()


def sent_bytes(manifest: SnapshotManifest) -> int:
    """The bytes a push of ``manifest`` (with its ``absent`` chunks) sends."""
    return sum(end - start for start, end in manifest.byte_ranges())
