"""The shared-memory arena: named files, removed on exit, checked before allocating."""

from __future__ import annotations

import os

import pytest

from peerckpt.errors import InsufficientMemory
from peerckpt.replication.arena import Arena
from peerckpt.shm import map_segment, sweep


def test_segments_are_named_for_the_job_and_removed_by_destroy(job) -> None:
    name, _ = job
    arena = Arena(name, node=3)
    seg = arena.create("o1-0", 1 << 20, "test slot")
    assert os.path.basename(seg.path).startswith(f"peerckpt-{name}-{arena.run}-n3-")
    assert os.path.exists(seg.path) and os.path.getsize(seg.path) == 1 << 20
    arena.destroy()
    assert not os.path.exists(seg.path)


def test_a_rank_mapping_shares_the_agents_bytes(job) -> None:
    name, _ = job
    arena = Arena(name, node=0)
    try:
        seg = arena.create("o0-0", 4096, "test slot")
        mm = map_segment(seg.path)
        mm[100:105] = b"hello"
        assert bytes(seg.view[100:105]) == b"hello"
        mm.close()
    finally:
        arena.destroy()


def test_asking_for_more_than_the_machine_has_names_the_shortfall_and_the_fix(job) -> None:
    name, _ = job
    arena = Arena(name, node=0)
    try:
        with pytest.raises(InsufficientMemory, match=r"needs 1024\.0 TiB.*short by.*--replicas"):
            arena.create("o0-0", 1 << 50, "own slot 0 of rank 0")
        assert arena.total_bytes() == 0
    finally:
        arena.destroy()


def test_sweep_removes_what_a_killed_agent_left(job) -> None:
    name, _ = job
    arena = Arena(name, node=1)
    seg = arena.create("r2-1", 4096, "replica")
    # The agent "dies": nothing unlinks its file, until the launcher sweeps the node.
    assert sweep(name, arena.run, node=0) == []
    assert sweep(name, arena.run, node=1) == [seg.path]
    assert not os.path.exists(seg.path)
    arena.destroy()
