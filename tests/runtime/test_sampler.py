"""ResumableSampler: exact resume, and every index exactly once across topology changes."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peerckpt.runtime.sampler import Reshardable, ResumableSampler

_MSGPACK_LEAVES = (type(None), bool, int, float, str, bytes, torch.Tensor)


def _assert_msgpack_friendly(value: Any, path: str = "state") -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str), f"{path} has a non-str key {key!r}"
            _assert_msgpack_friendly(item, f"{path}[{key!r}]")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _assert_msgpack_friendly(item, f"{path}[{i}]")
    else:
        assert isinstance(value, _MSGPACK_LEAVES), (
            f"{path} is a {type(value).__name__}, which msgpack cannot encode"
        )


def _transported(state: dict[str, Any]) -> dict[str, Any]:
    """The state as another process would receive it: no object shared with the sender."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _world(n: int, world_size: int, seed: int = 0) -> list[ResumableSampler]:
    return [ResumableSampler(n, r, world_size, seed=seed) for r in range(world_size)]


def _reshard(old: list[ResumableSampler], world_size: int) -> list[ResumableSampler]:
    """Every old rank's state, loaded into every rank of a new world, as recovery does."""
    states = [_transported(s.state_dict()) for s in old]
    new = []
    for rank in range(world_size):
        sampler = ResumableSampler(old[0].n, 0, 1, seed=old[0].state_dict()["seed"])
        sampler.load_resharded_state([_transported(st) for st in states], rank, world_size)
        new.append(sampler)
    return new


def _step(world: list[ResumableSampler], k: int, log: dict[int, Counter[int]]) -> None:
    """One lockstep training step: every rank takes a batch of ``k``."""
    for sampler in world:
        got = sampler.take(k)
        assert len(got) <= k
        log.setdefault(sampler.epoch, Counter()).update(got)
    states = [s.state_dict() for s in world]
    assert len({(st["data_epoch"], st["cursor"]) for st in states}) == 1, "ranks left lockstep"


def _exhausted(world: list[ResumableSampler]) -> bool:
    return all(s.state_dict()["cursor"] == s.state_dict()["span"] for s in world)


def _finish_epoch(world: list[ResumableSampler], k: int, log: dict[int, Counter[int]]) -> None:
    while not _exhausted(world):
        _step(world, k, log)


def _assert_exactly_once(n: int, log: dict[int, Counter[int]]) -> None:
    for epoch, counts in log.items():
        if n == 0:
            assert not counts
            continue
        assert set(counts) == set(range(n)), f"data epoch {epoch} lost indices"
        assert max(counts.values()) == 1, f"data epoch {epoch} repeated indices"
    if n:
        assert sorted(log) == list(range(len(log))), "a data epoch was skipped"


# -- shares and determinism ---------------------------------------------------------------------


@pytest.mark.parametrize("n,world_size", [(0, 1), (1, 3), (10, 4), (17, 5), (100, 1), (64, 8)])
def test_shares_partition_range_evenly(n: int, world_size: int) -> None:
    shares = [list(s) for s in _world(n, world_size, seed=3)]
    assert sorted(i for share in shares for i in share) == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_shares_are_strided_permutation() -> None:
    shares = [list(s) for s in _world(23, 4, seed=5)]
    perm = [0] * 23
    for rank, share in enumerate(shares):
        perm[rank::4] = share
    assert sorted(perm) == list(range(23))
    assert perm != list(range(23))


def test_same_shares_when_constructed_twice() -> None:
    for epoch in range(3):
        first, second = _world(97, 3, seed=11), _world(97, 3, seed=11)
        for a, b in zip(first, second, strict=True):
            a.set_epoch(epoch)
            b.set_epoch(epoch)
            assert list(a) == list(b)


def test_epochs_and_seeds_change_the_order() -> None:
    def order(seed: int, epoch: int) -> list[int]:
        sampler = ResumableSampler(200, 0, 1, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    assert order(0, 1) != order(1, 0)


def test_no_shuffle_is_identity() -> None:
    sampler = ResumableSampler(10, 1, 3, shuffle=False)
    assert list(sampler) == [1, 4, 7]
    assert list(sampler) == [1, 4, 7]  # the next data epoch, same order


def test_reshard_is_the_same_on_every_new_rank() -> None:
    old = _world(101, 4, seed=2)
    for s in old:
        s.take(7)
    first, second = _reshard(old, 3), _reshard(old, 3)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.state_dict()["share"], b.state_dict()["share"])
    lengths = [len(s) for s in first]
    assert sum(lengths) == 101 - 4 * 7
    assert max(lengths) - min(lengths) <= 1


def test_reshard_keeps_the_epoch_order() -> None:
    # With shuffle off the epoch's order is ascending; what is left keeps it, dealt round-robin.
    old = [ResumableSampler(20, r, 4, shuffle=False) for r in range(4)]
    for s in old:
        s.take(2)  # delivered 0..7
    new = [ResumableSampler(20, 0, 1, shuffle=False) for _ in range(3)]
    states = [s.state_dict() for s in old]
    for rank, s in enumerate(new):
        s.load_resharded_state(states, rank, 3)
    assert [list(s) for s in new] == [[8, 11, 14, 17], [9, 12, 15, 18], [10, 13, 16, 19]]


# -- consuming ----------------------------------------------------------------------------------


def test_take_stops_at_the_epoch_boundary_then_moves_on() -> None:
    sampler = ResumableSampler(10, 0, 1, seed=1)
    first = sampler.take(4) + sampler.take(4)
    last = sampler.take(4)
    assert len(last) == 2 and sampler.epoch == 0
    assert sorted(first + last) == list(range(10))
    assert len(sampler.take(4)) == 4 and sampler.epoch == 1


def test_shorter_share_stays_in_lockstep() -> None:
    world = _world(10, 4)  # shares 3, 3, 2, 2
    log: dict[int, Counter[int]] = {}
    for _ in range(3):
        _step(world, 1, log)
    assert _exhausted(world)
    _step(world, 1, log)
    assert {s.epoch for s in world} == {1}


def test_len_counts_what_iteration_yields() -> None:
    sampler = ResumableSampler(10, 2, 4)
    assert len(sampler) == 2
    sampler.take(1)
    assert len(sampler) == 1 == len(list(sampler))
    assert len(sampler) == 2  # exhausted: the next iteration is a whole new data epoch


def test_next_index_walks_through_epochs() -> None:
    sampler = ResumableSampler(5, 0, 2, seed=4)  # shares of 3 and 2
    got = [sampler.next_index() for _ in range(6)]
    assert sampler.epoch == 1
    for epoch, head in enumerate((got[:3], got[3:])):
        reference = ResumableSampler(5, 0, 2, seed=4)
        reference.set_epoch(epoch)
        assert head == list(reference)
    short = ResumableSampler(5, 1, 2, seed=4)
    assert [short.next_index() for _ in range(3)][2] in set(range(5)) and short.epoch == 1
    with pytest.raises(LookupError, match="smaller than the world size"):
        ResumableSampler(2, 3, 4).next_index()


def test_set_epoch_to_the_current_epoch_continues() -> None:
    sampler = ResumableSampler(30, 1, 2, seed=9)
    sampler.set_epoch(2)
    head = sampler.take(5)
    sampler.set_epoch(2)
    tail = list(sampler)
    reference = ResumableSampler(30, 1, 2, seed=9)
    reference.set_epoch(2)
    assert head + tail == list(reference)


def test_iterator_stops_when_state_is_replaced() -> None:
    sampler = ResumableSampler(50, 0, 1)
    it = iter(sampler)
    next(it)
    sampler.set_epoch(3)
    assert list(it) == []
    assert len(list(sampler)) == 50


# -- same-topology resume -----------------------------------------------------------------------


@pytest.mark.parametrize("steps", [0, 1, 5, 13, 14, 40])
def test_load_state_dict_continues_identically(steps: int) -> None:
    # 4 ranks, 50 indices, shares of 13 or 12: steps cover mid-epoch, boundary and epoch 2+.
    world, twin = _world(50, 4, seed=7), _world(50, 4, seed=7)
    for _ in range(steps):
        for s, t in zip(world, twin, strict=True):
            s.take(3)
            t.take(3)
    restored = []
    for rank, s in enumerate(world):
        fresh = ResumableSampler(50, rank, 4, seed=7)
        fresh.load_state_dict(_transported(s.state_dict()))
        restored.append(fresh)
    for _ in range(40):
        for r, t in zip(restored, twin, strict=True):
            assert r.take(3) == t.take(3)
            assert r.epoch == t.epoch


def test_load_state_dict_after_a_reshard_continues_identically() -> None:
    old = _world(60, 4, seed=1)
    for s in old:
        s.take(4)
    world = _reshard(old, 3)
    for s in world:
        s.take(2)
    restored = []
    for rank, s in enumerate(world):
        fresh = ResumableSampler(60, rank, 3, seed=1)
        fresh.load_state_dict(_transported(s.state_dict()))
        restored.append(fresh)
    for _ in range(20):
        for r, s in zip(restored, world, strict=True):
            assert r.take(5) == s.take(5)


def test_iteration_resumes_mid_epoch() -> None:
    sampler = ResumableSampler(40, 1, 3, seed=6)
    sampler.set_epoch(1)
    it = iter(sampler)
    head = [next(it) for _ in range(4)]
    restored = ResumableSampler(40, 1, 3, seed=6)
    restored.load_state_dict(_transported(sampler.state_dict()))
    restored.set_epoch(1)  # what the resumed loop does: continue, not restart
    reference = ResumableSampler(40, 1, 3, seed=6)
    reference.set_epoch(1)
    assert head + list(restored) == list(reference)


# -- exactly once across topology changes -------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 500),
    seed=st.integers(0, 2**31),
    first_world=st.integers(1, 8),
    segments=st.lists(
        st.tuples(
            st.lists(st.integers(1, 64), max_size=25),  # batch size of each step
            st.integers(1, 8),  # world size after the segment
            st.booleans(),  # on an unchanged world size: reshard anyway, or plain restore
        ),
        max_size=5,
    ),
    last_batch=st.integers(1, 64),
)
def test_every_index_exactly_once_across_topology_changes(
    n: int,
    seed: int,
    first_world: int,
    segments: list[tuple[list[int], int, bool]],
    last_batch: int,
) -> None:
    world = _world(n, first_world, seed)
    log: dict[int, Counter[int]] = {}
    for batches, world_size, reshard in segments:
        for k in batches:
            _step(world, k, log)
        if world_size != len(world) or reshard:
            world = _reshard(world, world_size)
            lengths = [len(s) for s in world if not _exhausted(world)]
            assert not lengths or max(lengths) - min(lengths) <= 1
        else:
            restored = []
            for rank, s in enumerate(world):
                fresh = ResumableSampler(n, rank, world_size, seed=seed)
                fresh.load_state_dict(_transported(s.state_dict()))
                restored.append(fresh)
            world = restored
        for s in world:
            _assert_msgpack_friendly(s.state_dict())
    _finish_epoch(world, last_batch, log)
    _assert_exactly_once(n, log)


@pytest.mark.parametrize("new_world", [1, 2, 3, 5, 8])
def test_change_in_the_middle_of_epoch_two(new_world: int) -> None:
    n, k = 103, 4
    world = _world(n, 4, seed=8)  # span 26 per data epoch
    log: dict[int, Counter[int]] = {}
    _finish_epoch(world, k, log)  # data epoch 0 done
    _step(world, k, log)
    _finish_epoch(world, k, log)  # data epoch 1 done
    for _ in range(3):
        _step(world, k, log)  # 12 positions into data epoch 2
    assert {s.epoch for s in world} == {2}
    world = _reshard(world, new_world)
    world = _reshard(world, 2)  # and again, straight after
    assert {s.epoch for s in world} == {2}
    _step(world, 3, log)
    world = _reshard(world, 6)
    _finish_epoch(world, k, log)
    _step(world, k, log)  # into data epoch 3, fresh on the new topology
    _finish_epoch(world, k, log)
    _assert_exactly_once(n, log)
    assert sorted(log) == [0, 1, 2, 3]


@pytest.mark.parametrize("old_world,new_world", [(4, 2), (2, 4), (3, 3), (1, 7)])
def test_change_at_an_exact_epoch_boundary(old_world: int, new_world: int) -> None:
    n, k = 42, 3
    world = _world(n, old_world, seed=12)
    log: dict[int, Counter[int]] = {}
    _finish_epoch(world, k, log)
    assert _exhausted(world) and {s.epoch for s in world} == {0}
    world = _reshard(world, new_world)
    assert _exhausted(world)  # nothing left of data epoch 0
    _step(world, k, log)
    assert {s.epoch for s in world} == {1}
    _finish_epoch(world, k, log)
    _assert_exactly_once(n, log)
    # The next data epoch is a fresh perm[r::new_world], as if the new world had always run.
    for rank, s in enumerate(world):
        fresh = ResumableSampler(n, rank, new_world, seed=12)
        fresh.set_epoch(2)
        assert list(s) == list(fresh)


def test_next_epoch_after_a_reshard_is_fresh_on_the_new_topology() -> None:
    n = 37
    world = _world(n, 4, seed=5)
    for s in world:
        s.take(3)
    world = _reshard(world, 3)
    log: dict[int, Counter[int]] = {}
    _finish_epoch(world, 2, log)
    for rank, s in enumerate(world):
        assert s.state_dict()["share"] is not None  # still spelled out until the epoch ends
        fresh = ResumableSampler(n, rank, 3, seed=5)
        fresh.set_epoch(1)
        assert list(s) == list(fresh)
        assert s.state_dict()["share"] is None  # compact again


# -- state format and validation ----------------------------------------------------------------


def test_states_are_msgpack_friendly_and_compact() -> None:
    world = _world(30, 3)
    for s in world:
        s.take(4)
        state = s.state_dict()
        _assert_msgpack_friendly(state)
        assert state["share"] is None
    for s in _reshard(world, 2):
        state = s.state_dict()
        _assert_msgpack_friendly(state)
        assert state["share"].dtype == torch.int64


def test_is_reshardable_and_a_sampler() -> None:
    sampler = ResumableSampler(4, 0, 1)
    assert isinstance(sampler, Reshardable)
    assert isinstance(sampler, torch.utils.data.Sampler)
    loader = torch.utils.data.DataLoader(list(range(4)), sampler=sampler, batch_size=2)
    assert sorted(int(i) for batch in loader for i in batch) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "args,match",
    [
        ((-1, 0, 1), "n must be >= 0"),
        ((10, 0, 0), "world_size must be >= 1"),
        ((10, 2, 2), r"rank must be in range\(world_size=2\)"),
        ((10, -1, 2), "rank must be >= 0"),
        ((10, True, 2), "rank must be an int"),
        ((10.0, 0, 1), "n must be an int"),
    ],
)
def test_bad_arguments_are_refused(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ResumableSampler(*args)


def test_bad_calls_are_refused() -> None:
    sampler = ResumableSampler(10, 0, 2)
    with pytest.raises(ValueError, match="k must be >= 0"):
        sampler.take(-1)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        sampler.set_epoch(-1)
    with pytest.raises(ValueError, match="rank must be in range"):
        sampler.load_resharded_state([sampler.state_dict()], 3, 2)


def test_states_at_different_epochs_are_refused() -> None:
    world = _world(10, 2)
    world[0].set_epoch(1)
    with pytest.raises(ValueError, match="different data epochs"):
        ResumableSampler(10, 0, 1).load_resharded_state([s.state_dict() for s in world], 0, 1)


def test_incomplete_or_misordered_states_are_refused() -> None:
    states = [s.state_dict() for s in _world(10, 3)]
    with pytest.raises(ValueError, match="every old rank's state, in rank order"):
        ResumableSampler(10, 0, 1).load_resharded_state(states[:2], 0, 1)
    with pytest.raises(ValueError, match="every old rank's state, in rank order"):
        ResumableSampler(10, 0, 1).load_resharded_state(states[::-1], 0, 1)
    with pytest.raises(ValueError, match="got none"):
        ResumableSampler(10, 0, 1).load_resharded_state([], 0, 1)


def test_overlapping_states_are_refused() -> None:
    old = _world(20, 2)
    states = [s.state_dict() for s in _reshard(old, 2)]
    states[1]["share"] = states[0]["share"].clone()
    with pytest.raises(ValueError, match="same index twice"):
        ResumableSampler(20, 0, 1).load_resharded_state(states, 0, 1)


def test_foreign_states_are_refused() -> None:
    state = ResumableSampler(10, 1, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="load_resharded_state"):
        ResumableSampler(10, 0, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"\(n, seed, shuffle\)"):
        ResumableSampler(10, 1, 2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        ResumableSampler(10, 1, 2, seed=1).load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="cursor"):
        ResumableSampler(10, 1, 2, seed=1).load_state_dict({**state, "cursor": 6})


def test_set_epoch_before_a_resumed_loop_does_not_rewind_the_restored_data_epoch() -> None:
    """DistributedSampler's habit: ``sampler.set_epoch(epoch)`` with ``epoch = 0`` made before
    the loop. After a restore into data epoch 2 that call is ignored (it rewound the sampler,
    silently), and once the loop has taken indices set_epoch moves as before."""
    original = ResumableSampler(12, 0, 1, seed=3)
    original.set_epoch(2)
    original.take(4)
    resumed = ResumableSampler(12, 0, 1, seed=3)
    resumed.load_state_dict(original.state_dict())
    resumed.set_epoch(0)
    assert resumed.epoch == 2 and resumed.take(4) == original.take(4)
    resumed.set_epoch(0)  # asked for by the loop itself: obeyed
    assert resumed.epoch == 0
