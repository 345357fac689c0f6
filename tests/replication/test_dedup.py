"""Redundancy-aware replication, the agent's side (replication/dedup.py) and partial copies
(manifest byte ranges, a partial push and fetch through a data server)."""

from __future__ import annotations

from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.membership import Membership, RankAssignment
from peerckpt.replication import dedup


def _manifest(twins: list[int] | None = None) -> SnapshotManifest:
    chunks = (
        ChunkRecord("m/w", "float32", (16,), (0,), (16,), 0, 64, crc=1),
        ChunkRecord("data/pos", "int64", (1,), (0,), (1,), 64, 8, crc=2, scope="rank"),
        ChunkRecord("m/b", "float32", (16,), (0,), (16,), 128, 64, crc=3),
        ChunkRecord("__meta__", "uint8", (10,), (0,), (10,), 192, 10, crc=4, scope="rank"),
    )
    return SnapshotManifest(0, 3, 0, chunks, 202, extra={"twins": twins} if twins else {})


def _members(nodes: dict[int, int], k: int) -> Membership:
    node_set = sorted(set(nodes.values()))
    placement = {
        r: [node_set[(node_set.index(n) + i) % len(node_set)] for i in range(1, k + 1)]
        for r, n in nodes.items()
    }
    return Membership(
        epoch=0,
        world_size=len(nodes),
        ranks={r: RankAssignment(r, n, 100 + r) for r, n in nodes.items()},
        placement=placement,
        restore_step=None,
        sources={},
        node_addrs={},
        store_addr="",
    )


def test_declared_chunks_are_left_out_when_ranks_span_enough_nodes() -> None:
    members = _members({0: 0, 1: 0, 2: 1, 3: 1}, k=1)
    assert dedup.absent_chunks(_manifest([0, 2]), members, 2) == (0, 2)
    assert dedup.absent_chunks(_manifest(), members, 2) == ()  # nothing declared (dedup=False)


def test_nothing_is_left_out_without_buddies() -> None:
    assert dedup.absent_chunks(_manifest([0, 2]), _members({0: 0, 1: 0}, k=0), 1) == ()


def test_a_partial_copy_holds_the_other_chunks_only() -> None:
    partial = _manifest([0, 2]).without((0, 2))
    assert partial.absent == (0, 2)
    assert partial.byte_ranges() == [(64, 72), (192, 202)]
    assert [c.key for c in partial.present()] == ["data/pos", "__meta__"]
    assert dedup.sent_bytes(partial) == 18
    assert partial.without(()).absent == () and partial.without(()).byte_ranges() == [(0, 202)]
    # the message form keeps it, checked
    assert SnapshotManifest.from_msg(partial.to_msg()).absent == (0, 2)


def test_twin_digest_follows_the_declared_chunks_checksums_only() -> None:
    a = _manifest([0, 2])
    other_private = a.with_crcs([1, 99, 3, 98])  # private state and blob differ
    assert dedup.twin_digest(a) == dedup.twin_digest(other_private)
    assert dedup.twin_digest(a) != dedup.twin_digest(a.with_crcs([1, 2, 7, 4]))
    assert dedup.twin_digest(_manifest()) == ""


def test_a_manifest_naming_a_chunk_it_lacks_out_of_range_is_refused() -> None:
    msg = _manifest().to_msg()
    msg["extra"] = {"absent": [9]}
    try:
        SnapshotManifest.from_msg(msg)
    except Exception as exc:
        assert "absent" in str(exc)
    else:
        raise AssertionError("an out-of-range absent index must be refused")
