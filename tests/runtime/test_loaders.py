"""runtime/loaders.py: a tracked StatefulDataLoader's workers resume their random draws exactly,
the user's dataset is left as it is, and what cannot be restored is named."""

from __future__ import annotations

import gc
import random
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    default_collate,
    get_worker_info,
)

from peerckpt.runtime import loaders
from peerckpt.runtime.capture import capture
from peerckpt.runtime.loaders import RNG_KEY, WorkerRngDataset

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


class Noisy(Dataset):
    """Draws from torch, random and numpy in __getitem__; checks what the worker sees."""

    label = "mine"

    def __len__(self) -> int:
        return 128

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        assert info is None or type(info.dataset) is Noisy, type(info.dataset)
        return torch.tensor([i, random.randrange(1000), int(np.random.randint(1000))]).float() + (
            torch.rand(3)
        )


def masking(items: list) -> torch.Tensor:
    batch = default_collate(items)
    return batch.masked_fill(torch.rand(batch.shape) < 0.3, -1.0)


class Counted(Noisy):
    """A dataset with a state of its own."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]


def _loader(install: bool, every: int = 1, persistent: bool = False, **kw) -> StatefulDataLoader:
    data = Noisy()
    sampler = DistributedSampler(data, 2, 1, shuffle=True, seed=1)
    loader = StatefulDataLoader(
        data,
        batch_size=4,
        sampler=sampler,
        num_workers=2,
        collate_fn=masking,
        snapshot_every_n_steps=every,
        persistent_workers=persistent,
        **kw,
    )
    if install:
        loaders.install({"data": loader})
    return loader


def _resumes(install: bool, every: int = 1, persistent: bool = False) -> list[int]:
    """The batches (of 16) that differ after a restore at each of several steps."""
    differ = []
    for cut in (0, 3):
        torch.manual_seed(1)
        first = _loader(install, every, persistent)
        it = iter(first)
        for _ in range(cut):
            next(it)
        state = first.state_dict()
        expected = [next(it) for _ in range(16 - cut)]
        del it, first
        torch.manual_seed(2)  # the main process's generator is not what restores the workers
        again = _loader(install, every, persistent)
        again.load_state_dict(state)
        got = list(again)
        assert len(got) == len(expected)
        differ += [
            cut + k
            for k, (a, b) in enumerate(zip(got, expected, strict=True))
            if not torch.equal(a, b)
        ]
        del again
    return differ


def test_torchdatas_own_restore_draws_other_numbers_in_its_workers() -> None:
    assert _resumes(install=False)  # why the wrapper exists


@pytest.mark.parametrize("every, persistent", [(1, False), (3, False), (1, True)])
def test_installed_workers_resume_their_draws_exactly(every: int, persistent: bool) -> None:
    assert _resumes(install=True, every=every, persistent=persistent) == []


def test_the_loader_keeps_the_users_dataset_and_init_function() -> None:
    calls = []
    loader = _loader(True, worker_init_fn=calls.append)
    data, init = loader.dataset, loader.worker_init_fn
    batches = list(loader)  # Noisy asserts that get_worker_info() gives it, not the wrapper
    assert len(batches) == 16
    assert loader.dataset is data and type(loader.dataset) is Noisy
    assert loader.worker_init_fn is init
    loaders.install({"data": loader})  # again, as in a later epoch: one layer only
    assert loaders.wrapped(loader)
    assert len(list(loader)) == 16


def test_installing_makes_no_reference_cycle() -> None:
    loader = _loader(True)
    gone = weakref.ref(loader)
    gc.disable()  # freed by reference counting, in this process, not by a later collection
    try:
        del loader
        assert gone() is None
    finally:
        gc.enable()


def test_the_wrapper_is_the_dataset_for_items_length_and_attributes() -> None:
    inner = Noisy()
    wrapped = WorkerRngDataset(inner)
    assert len(wrapped) == 128 and wrapped.label == "mine"
    state = WorkerRngDataset(inner).state_dict()
    a = wrapped[5]
    wrapped.load_state_dict(state)
    assert torch.equal(a, inner[5])
    assert not hasattr(wrapped, "__getitems__")  # the fetcher indexes one by one, as before
    inner.__getitems__ = lambda idx: [inner[i] for i in idx]  # type: ignore[attr-defined]
    assert len(wrapped.__getitems__([1, 2])) == 2


def test_the_wrappers_state_holds_the_generators_and_the_datasets_own_state() -> None:
    inner = Counted()
    wrapped = WorkerRngDataset(inner)
    inner.calls = 7
    state = wrapped.state_dict()
    draws = (torch.rand(2), random.random(), np.random.rand())
    inner.calls = 9
    wrapped.load_state_dict(state)
    assert inner.calls == 7
    again = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]
    wrapped.load_state_dict({"calls": 3})  # a state saved before the wrapper: the dataset's
    assert inner.calls == 3
    assert "cuda" not in state[RNG_KEY] and "cuda_seed" not in state[RNG_KEY]


def test_the_loaders_state_is_snapshotted() -> None:
    loader = _loader(True)
    it = iter(loader)
    next(it)
    captured = capture({"data": loader}, 0, {})  # tensors, lists, bytes: no pickling
    assert captured.blob
    del it, loader


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_what_cannot_be_restored_is_named() -> None:
    before = StatefulDataLoader(Noisy(), batch_size=4, num_workers=1)
    it_before = iter(before)  # workers made before ctx.track
    loaders.install({"early": before})
    stream = StatefulDataLoader(Stream(), batch_size=4, num_workers=1)
    plain = DataLoader(Noisy(), batch_size=4, num_workers=1)
    it_plain = iter(plain)
    fine = _loader(True)
    it_fine = iter(fine)
    tracked = {"early": before, "stream": stream, "data": fine}
    found = loaders.notes(tracked, [o for o in gc.get_objects() if o is it_plain])
    assert len(found) == 3, found
    early, iterable, untracked = found
    assert "early (a StatefulDataLoader over a Noisy)" in early and "after ctx.track" in early
    assert "over an IterableDataset" in iterable and "stream" in iterable
    assert "a torch DataLoader over a Noisy iterates with 1 worker" in untracked
    assert "StatefulDataLoader tracked as data" in untracked
    assert loaders.notes({"data": fine}, []) == []
    del it_before, it_plain, it_fine


def test_the_first_snapshots_audit_names_a_plain_loaders_workers() -> None:
    from peerckpt.runtime.audit import findings

    plain = DataLoader(Noisy(), batch_size=4, num_workers=1)
    it = iter(plain)
    found = findings({}, [], [], [], [plain, it])
    assert [f for f in found if "iterates with 1 worker process:" in f], found
    del it


def test_a_plain_dataloader_tracked_is_refused_at_track_naming_the_loaders_that_keep_a_place() -> (
    None
):
    """The distributed tutorial's loop, ported as written: ``ctx.track(data=train_set)`` on a
    torch DataLoader failed at the first snapshot, saying only that it has no state_dict()."""
    from peerckpt.errors import StateMismatch
    from peerckpt.runtime.tracking import refuse_unsupported

    with pytest.raises(StateMismatch) as refused:
        refuse_unsupported("data", DataLoader(Noisy(), batch_size=4))
    assert str(refused.value).startswith("ctx.track: data is a torch DataLoader, which keeps no")
    assert "StatefulDataLoader" in str(refused.value)
    assert "peerckpt.ResumableSampler" in str(refused.value)
    refuse_unsupported("data", StatefulDataLoader(Noisy(), batch_size=4))  # keeps its place


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restored_loader_resumes_its_epoch_without_moving_torchs_generator(workers: int) -> None:
    """Seen with lucidrains' ``cycle(loader)``: a restored process makes the loader's iterator
    inside its first step, where the fault-free run made none; iter() drew a seed from torch's
    generator (a shuffling sampler's, the workers' base seed), and every later step drew other
    numbers (MISMATCH after a kill, with the StatefulDataLoader tracked as advised). A resumed
    iterator now leaves the generator as it was; a new data epoch still draws, as it did."""
    data = torch.arange(32.0)

    def loader() -> Any:
        return StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=workers)

    torch.manual_seed(5)
    first = loader()
    it = iter(first)
    taken = [next(it) for _ in range(3)]
    state = first.state_dict()
    rest = [b.tolist() for b in it]  # the epoch's last five batches
    assert len(taken) + len(rest) == 8
    restored = loader()
    restored.load_state_dict(state)
    loaders.install({"data": restored})
    before = torch.get_rng_state()
    resumed = iter(restored)
    assert torch.equal(torch.get_rng_state(), before)  # the resume drew nothing
    assert [b.tolist() for b in resumed] == rest
    iter(restored)  # a new epoch draws its order, as the fault-free run's did
    assert not torch.equal(torch.get_rng_state(), before)
