"""Data-loader state that survives a topology change: ``Reshardable`` and ``ResumableSampler``.

This module owns the ``Reshardable`` protocol (per-rank state that must be redistributed, not
copied, when the world shrinks or grows) and one implementation of it: a distributed sampler
over ``range(n)`` that delivers every index of a data epoch exactly once across all ranks, even
when the world changes in the middle of that data epoch, any number of times.

A *data epoch* here is one pass over the data set; it is unrelated to peerckpt's membership
epoch. The state dict therefore calls it ``data_epoch``; ``set_epoch`` keeps its name because
that is what ``torch.utils.data.DistributedSampler`` and training loops already call.

Lockstep. Ranks of a data epoch advance a shared *cursor* over ``span`` positions, where
``span`` is the length of the longest share. A rank whose share is one shorter delivers nothing
at its last position; so ``take(k)``, called once per step on every rank, keeps every rank at
the same data epoch and cursor, and the states captured at a committed step always agree.

This module is pure: no I/O, no process group, no logging. The states it produces hold only
msgpack-encodable values (ints, bools, None, one int64 tensor) and are never pickled.

Its length (~460 lines) is one algorithm (the lockstep cursor and its redistribution) with
its invariants written beside each step; split, the invariants would lose their code.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import Sampler

log = logging.getLogger("peerckpt.rank")

__all__ = ["Reshardable", "ResumableSampler"]

_STATE_VERSION = 1
_STATE_KEYS = frozenset(
    (
        "version",
        "n",
        "seed",
        "shuffle",
        "rank",
        "world_size",
        "data_epoch",
        "cursor",
        "span",
        "share",
    )
)
# Indices are turned into Python ints this many at a time while iterating: one ``tolist`` per
# chunk instead of one tensor ``item()`` per index, without materialising a whole share.
_ITER_CHUNK = 1024


@runtime_checkable
class Reshardable(Protocol):
    """Per-rank state that can be restored into a different world size.

    Call order, on every rank of the new world after a committed step is restored:

    * same topology (same world size, same rank): ``load_state_dict(state)`` with this rank's
      own ``state_dict()`` from the committed step;
    * after a topology change: ``load_resharded_state(states, rank, world_size)`` instead,
      with the states of *all* old ranks, identical on every new rank.

    ``state_dict`` is called on every rank at every snapshot; what it returns must be
    msgpack-encodable (dicts with str keys, lists, tuples, ints, floats, str, bytes, bools,
    None, torch tensors) and must not be mutated in place afterwards.
    """

    def state_dict(self) -> dict[str, Any]:
        """Return this rank's state at the current step."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state this same rank returned from ``state_dict`` at the committed step."""
        ...

    def load_resharded_state(
        self, states: list[dict[str, Any]], rank: int, world_size: int
    ) -> None:
        """Called instead of load_state_dict after a topology change, on every new rank, with the
        state of every old rank (states[i] is old rank i's state_dict() at the committed step),
        and this process's new rank and world size. Take your share of what is left."""
        ...


class ResumableSampler(Sampler[int]):
    """Distributed sampler over ``range(n)`` with exact resume and resharding.

    Each data epoch ``e`` draws a permutation of ``range(n)`` from a ``torch.Generator`` seeded
    with ``(seed, e)`` (the identity when ``shuffle=False``); rank ``r`` of ``world_size``
    delivers ``perm[r::world_size]``. After ``load_resharded_state`` the rest of the current
    data epoch is redistributed over the new world; the next data epoch starts afresh on it.

    Two ways to consume it:

    * ``take(k)`` once per training step on every rank (the lockstep way, which this project's
      loops use): up to ``k`` indices, fewer at the end of a data epoch. When the data epoch
      is exhausted, the next call moves to the next data epoch first.
    * ``for epoch in ...: sampler.set_epoch(epoch); for i in sampler: ...`` like
      ``DistributedSampler``. Iterating an exhausted sampler without ``set_epoch`` moves to the
      next data epoch, so plain repeated iteration also walks through data epochs.

    ``set_epoch`` to the current data epoch is a no-op: a loop resumed from a snapshot calls it
    again and must continue where it stopped, not restart the data epoch.

    The state advances as indices are handed out. A ``DataLoader`` with workers pulls indices
    ahead of training, so a snapshot of a sampler iterated by one would be ahead of the model;
    take indices with ``take`` in the training loop instead.
    """

    def __init__(
        self, n: int, rank: int, world_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        """Create the sampler at data epoch 0, nothing delivered yet.

        Raises ValueError if ``n`` is negative, ``world_size`` is below 1 or ``rank`` is not in
        ``range(world_size)``.
        """
        super().__init__()
        _check_int("n", n, minimum=0)
        _check_topology(rank, world_size)
        _check_int("seed", seed)
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be a bool, got {shuffle!r}")
        self._n = n
        self._seed = seed
        self._shuffle = shuffle
        self._rank = rank
        self._world_size = world_size
        self._data_epoch = 0
        self._cursor = 0
        self._span = _ceil_div(n, world_size)
        # Set only after a reshard: this rank's share of the current data epoch, spelled out.
        self._resharded: torch.Tensor | None = None
        # This rank's share of the current data epoch, computed on first use.
        self._share_cache: torch.Tensor | None = None
        # Bumped whenever the position is replaced wholesale, so that a live iterator stops
        # instead of walking on through a share it no longer belongs to.
        self._generation = 0
        # Restored, nothing taken since: the code before a resumed loop may call
        # set_epoch(0) (DistributedSampler's habit), which must not rewind it.
        self._restored = False

    # -- what the sampler is ------------------------------------------------------------------

    @property
    def n(self) -> int:
        """Size of the index space ``range(n)``."""
        return self._n

    @property
    def rank(self) -> int:
        """This rank in the current world."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the current world."""
        return self._world_size

    @property
    def epoch(self) -> int:
        """The current data epoch."""
        return self._data_epoch

    def __len__(self) -> int:
        """Indices the next ``iter(self)`` yields: what is left of the current data epoch, or
        this rank's full share of the next one when the current one is exhausted."""
        if self._exhausted():
            return _share_len(self._n, self._rank, self._world_size)
        return self._share_len() - self._delivered()

    # -- consuming -----------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Move to data epoch ``epoch`` on the current topology, nothing of it delivered.

        A no-op when ``epoch`` is the current data epoch, so that a resumed loop continues;
        also, after a restore and before anything is taken, when ``epoch`` is an earlier one
        (the code before a resumed loop calling ``set_epoch(0)``, as with DistributedSampler).
        """
        _check_int("epoch", epoch, minimum=0)
        if self._restored and epoch < self._data_epoch:
            log.info(
                "ResumableSampler.set_epoch(%d) after a restore into data epoch %d: ignored, "
                "the loop resumes the restored data epoch",
                epoch,
                self._data_epoch,
            )
            return
        if epoch != self._data_epoch:
            self._start_epoch(epoch)

    def take(self, k: int) -> list[int]:
        """Advance the cursor by up to ``k`` positions and return this rank's indices there.

        Call it on every rank with the same ``k`` each step. It never crosses a data epoch
        boundary: at the end of a data epoch it returns fewer than ``k`` indices (possibly
        none on a rank whose share is one shorter), and the call after that starts the next
        data epoch.
        """
        _check_int("k", k, minimum=0)
        self._restored = False
        if k == 0:
            return []
        if self._exhausted():
            self._start_epoch(self._data_epoch + 1)
        share = self._share()
        start = min(self._cursor, share.numel())
        self._cursor = min(self._cursor + k, self._span)
        stop = min(self._cursor, share.numel())
        return [int(i) for i in share[start:stop].tolist()]

    def next_index(self) -> int:
        """Return the next index this rank delivers, moving into the next data epoch if needed.

        For loops that consume one index at a time; lockstep loops use ``take``. Raises
        LookupError if this rank's share is empty (``n`` smaller than ``world_size``).
        """
        # Two data epochs at most: the rest of this one, then a fresh one, whose share length
        # (that of perm[rank::world_size]) is the same for every later data epoch too.
        for _ in range(2):
            if self._exhausted():
                self._start_epoch(self._data_epoch + 1)
            share = self._share()
            delivered = self._delivered()
            if delivered < share.numel():
                self._cursor = delivered + 1
                return int(share[delivered])
            self._cursor = self._span
        raise LookupError(
            f"rank {self._rank} of {self._world_size} has no indices: n={self._n} is smaller "
            "than the world size; use fewer ranks or more data"
        )

    def __iter__(self) -> Iterator[int]:
        """Yield what is left of the current data epoch (or all of the next, if it is done)."""
        self._restored = False
        if self._exhausted():
            self._start_epoch(self._data_epoch + 1)
        generation = self._generation
        share = self._share()
        while self._generation == generation and self._delivered() < share.numel():
            start = self._delivered()
            for i in share[start : start + _ITER_CHUNK].tolist():
                if self._generation != generation:
                    return
                self._cursor = self._delivered() + 1
                yield int(i)
        if self._generation == generation:
            # A shorter share ends one position early; close the data epoch for every rank.
            self._cursor = self._span

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return the position as msgpack-encodable values.

        Keys: ``version``; ``n``, ``seed``, ``shuffle`` (what the permutations are);
        ``rank``, ``world_size`` (whose share); ``data_epoch``; ``cursor`` (positions passed
        in this data epoch) and ``span`` (positions in it); ``share``: None while the share is
        ``perm[rank::world_size]``, or after a reshard this rank's share of the current data
        epoch as a 1-D int64 tensor. The tensor is shared, not copied: the sampler never
        writes to it.
        """
        return {
            "version": _STATE_VERSION,
            "n": self._n,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "rank": self._rank,
            "world_size": self._world_size,
            "data_epoch": self._data_epoch,
            "cursor": self._cursor,
            "span": self._span,
            "share": self._resharded,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state this rank saved on the same topology; the next indices are exactly
        those that would have come without the interruption.

        Raises ValueError if the state is malformed, describes other data (``n``, ``seed``,
        ``shuffle``) or another rank or world size (use ``load_resharded_state`` for that).
        """
        _check_state(state, self._n, self._seed, self._shuffle)
        if (state["rank"], state["world_size"]) != (self._rank, self._world_size):
            raise ValueError(
                f"state is of rank {state['rank']} of {state['world_size']}, this sampler is "
                f"rank {self._rank} of {self._world_size}; after a topology change call "
                "load_resharded_state with every old rank's state"
            )
        share = state["share"]
        self._set_position(
            data_epoch=state["data_epoch"],
            cursor=state["cursor"],
            span=state["span"],
            resharded=None if share is None else share.clone(),
        )
        self._restored = True

    def load_resharded_state(
        self, states: list[dict[str, Any]], rank: int, world_size: int
    ) -> None:
        """Continue the old world's data epoch on a new topology.

        The indices no old rank has delivered yet, put back in the order of the data epoch's
        permutation, are dealt round-robin over the new ranks: new rank ``r`` gets
        ``rest[r::world_size]``. Every new rank computes the same split from the same
        ``states``, shares differ in length by at most one, and the next data epoch starts
        afresh as ``perm[rank::world_size]``.

        Raises ValueError if ``states`` is empty, malformed, not one state per old rank in
        rank order, at different data epochs, describes other data, or overlaps.
        """
        _check_topology(rank, world_size)
        if not states:
            raise ValueError("load_resharded_state needs the state of every old rank, got none")
        for state in states:
            _check_state(state, self._n, self._seed, self._shuffle)
        for i, state in enumerate(states):
            if (state["rank"], state["world_size"]) != (i, len(states)):
                raise ValueError(
                    f"states[{i}] is of rank {state['rank']} of {state['world_size']}, expected "
                    f"rank {i} of {len(states)}: pass every old rank's state, in rank order"
                )
        epochs = sorted({state["data_epoch"] for state in states})
        if len(epochs) > 1:
            raise ValueError(
                f"old ranks' states are at different data epochs {epochs}: they must all be "
                "captured at the same committed step"
            )
        data_epoch = epochs[0]
        perm = _permutation(self._n, self._seed, data_epoch, self._shuffle)
        remainders = []
        for state in states:
            share = state["share"]
            if share is None:
                share = perm[state["rank"] :: state["world_size"]]
            remainders.append(share[min(state["cursor"], share.numel()) :])
        rest = _in_permutation_order(torch.cat(remainders), perm)
        self._rank, self._world_size = rank, world_size
        self._set_position(
            data_epoch=data_epoch,
            cursor=0,
            span=_ceil_div(rest.numel(), world_size),
            resharded=rest[rank::world_size].clone(),
        )
        self._restored = True

    # -- internals ---------------------------------------------------------------------------

    def _start_epoch(self, data_epoch: int) -> None:
        self._set_position(
            data_epoch=data_epoch,
            cursor=0,
            span=_ceil_div(self._n, self._world_size),
            resharded=None,
        )

    def _set_position(
        self, *, data_epoch: int, cursor: int, span: int, resharded: torch.Tensor | None
    ) -> None:
        self._data_epoch = data_epoch
        self._cursor = cursor
        self._span = span
        self._resharded = resharded
        self._share_cache = None
        self._generation += 1

    def _share(self) -> torch.Tensor:
        if self._resharded is not None:
            return self._resharded
        if self._share_cache is None:
            perm = _permutation(self._n, self._seed, self._data_epoch, self._shuffle)
            # clone: keep only this rank's slice alive, not the whole permutation.
            self._share_cache = perm[self._rank :: self._world_size].clone()
        return self._share_cache

    def _share_len(self) -> int:
        if self._resharded is not None:
            return self._resharded.numel()
        return _share_len(self._n, self._rank, self._world_size)

    def _delivered(self) -> int:
        return min(self._cursor, self._share_len())

    def _exhausted(self) -> bool:
        return self._cursor >= self._span


def _permutation(n: int, seed: int, data_epoch: int, shuffle: bool) -> torch.Tensor:
    """The order of data epoch ``data_epoch``: the same on every process and every host."""
    if not shuffle:
        return torch.arange(n, dtype=torch.int64)
    generator = torch.Generator()
    # One seed from the pair; the large odd multiplier keeps (seed, epoch) pairs apart.
    generator.manual_seed((seed * 0x9E3779B97F4A7C15 + data_epoch) % (1 << 63))
    return torch.randperm(n, generator=generator, dtype=torch.int64)


def _in_permutation_order(indices: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Sort ``indices`` by their place in ``perm``, so that the rest of a data epoch keeps the
    data epoch's own order whichever old ranks held it; raise if an index is out of range or
    held twice (states from different steps)."""
    n = perm.numel()
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= n):
        raise ValueError(f"states hold indices outside range({n}): they are not of this data")
    place = torch.empty(n, dtype=torch.int64)
    place[perm] = torch.arange(n, dtype=torch.int64)
    places, order = torch.sort(place[indices], stable=True)
    if bool((places[1:] == places[:-1]).any()):
        raise ValueError(
            "old ranks' states hold the same index twice: they are not all from one committed step"
        )
    return indices[order]


def _check_state(state: dict[str, Any], n: int, seed: int, shuffle: bool) -> None:
    """Raise ValueError unless ``state`` is a well-formed sampler state of the same data."""
    if not isinstance(state, dict):
        raise ValueError(f"a sampler state is a dict, got {type(state).__name__}")
    if state.get("version") != _STATE_VERSION:
        raise ValueError(
            f"sampler state version {state.get('version')!r} is not {_STATE_VERSION}: it was "
            "saved by another version of peerckpt"
        )
    missing = _STATE_KEYS - state.keys()
    if missing:
        raise ValueError(f"sampler state lacks {sorted(missing)}")
    ours, theirs = (n, seed, shuffle), (state["n"], state["seed"], state["shuffle"])
    if ours != theirs:
        raise ValueError(
            f"sampler state is of (n, seed, shuffle)={theirs}, this sampler is {ours}: "
            "construct the sampler with the same data set and seed"
        )
    _check_topology(state["rank"], state["world_size"])
    _check_int("data_epoch", state["data_epoch"], minimum=0)
    _check_int("span", state["span"], minimum=0)
    _check_int("cursor", state["cursor"], minimum=0)
    if state["cursor"] > state["span"]:
        raise ValueError(f"sampler state cursor {state['cursor']} is past span {state['span']}")
    share = state["share"]
    if share is None and state["span"] != _ceil_div(state["n"], state["world_size"]):
        raise ValueError(
            f"sampler state span {state['span']} does not fit n={state['n']} over "
            f"world_size={state['world_size']}"
        )
    if share is not None and (
        not isinstance(share, torch.Tensor) or share.dtype != torch.int64 or share.dim() != 1
    ):
        raise ValueError("sampler state share must be None or a 1-D int64 tensor")
    if share is not None and share.numel() > state["span"]:
        raise ValueError(f"sampler state share has {share.numel()} indices, span {state['span']}")


def _check_topology(rank: int, world_size: int) -> None:
    _check_int("world_size", world_size, minimum=1)
    _check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank must be in range(world_size={world_size}), got {rank}")


def _check_int(name: str, value: object, minimum: int | None = None) -> None:
    # bool is an int subclass; a True rank is a bug, not rank 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _share_len(n: int, rank: int, world_size: int) -> int:
    """Length of ``range(n)[rank::world_size]``."""
    return _ceil_div(max(n - rank, 0), world_size)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
