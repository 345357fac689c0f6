"""The random draws of a tracked ``StatefulDataLoader``'s worker processes, restored with it.

A DataLoader worker seeds torch, ``random`` and numpy once, when it starts (``base_seed +
worker id``), and every random draw made in it — an augmentation in the dataset's
``__getitem__``, MLM masking in ``collate_fn`` — advances those generators. torchdata 0.11's
``StatefulDataLoader`` saves its workers' positions but not these generators: after
``load_state_dict`` its new workers start from the seed again, so the batches after a restore
hold other draws than a fault-free run's (measured: 156 digest differences in a 4-rank MNIST
job with a random shift, none without it).

What it does save, per worker, is the dataset's own state: in the worker, after every batch
it fetches for a snapshot (every batch with the default ``snapshot_every_n_steps=1``; with n,
the batches around each n-th, the others replayed on restore), it calls
``dataset.state_dict()`` when the dataset has one, and a restored worker calls
``dataset.load_state_dict`` after seeding and after ``worker_init_fn``. So when
``ctx.track`` gets a ``StatefulDataLoader`` with workers over a map-style dataset,
``install`` makes the iterators it creates from then on hand their workers a
:class:`WorkerRngDataset`: the user's dataset, whose state also carries the worker's torch,
``random`` and numpy generator states (``collate_fn`` runs in the worker and draws from the
same ones). The loader's ``dataset`` stays the user's object, and in a worker
``get_worker_info().dataset`` is the user's object too; only the iterator's private
``_dataset`` is the wrapper. The cost, per batch fetched for a snapshot: about 0.1 ms
in the worker to read the generator states and compare them with the last ones, and the
changed ones (5 to 11 KB) on its result queue.

Not restored, which ``notes`` names at the first snapshot: draws in the workers of a loader
whose iterator existed before ``ctx.track`` (its workers were started without the wrapper),
of a ``StatefulDataLoader`` over an ``IterableDataset`` (its state is its iterator's, not the
dataset's), and of a plain ``DataLoader`` (no state at all; its workers are seeded again from
the main process's generator whenever an iterator is made). Generators the user creates
(``torch.Generator``, ``numpy.random.default_rng``) are the dataset's own state: its
``state_dict`` must hold them.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils import worker as torch_worker

from peerckpt.runtime.capture import capture_rng, restore_rng

RNG_KEY = "peerckpt_worker_rng"  # the worker's generator states in the dataset's state
DATA_KEY = "peerckpt_dataset"  # the user's dataset state beside them


def stateful(obj: object) -> bool:
    """Whether ``obj`` has ``state_dict`` and ``load_state_dict`` (torch's Stateful)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def worker_rng() -> dict[str, Any]:
    """This process's torch, ``random`` and numpy generator states (a worker uses no CUDA)."""
    rng = capture_rng()
    rng.pop("cuda", None)
    rng.pop("cuda_seed", None)
    return rng


class WorkerRngDataset(Dataset):
    """The user's map-style ``dataset`` as a worker of a tracked ``StatefulDataLoader`` sees
    it: items, length and attributes are the dataset's; ``state_dict`` adds the worker's
    generator states to the dataset's own state, and ``load_state_dict`` puts them back last
    (after the dataset's, which may draw)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (while unpickling in a spawned worker)
            raise AttributeError(name)
        return getattr(self.dataset, name)  # __getitems__ and the user's attributes

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {RNG_KEY: worker_rng()}
        if stateful(self.dataset):
            state[DATA_KEY] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if RNG_KEY not in state:  # a state saved without the wrapper: the dataset's own
            if stateful(self.dataset):
                self.dataset.load_state_dict(state)
            return
        if DATA_KEY in state and stateful(self.dataset):
            self.dataset.load_state_dict(state[DATA_KEY])
        restore_rng(state[RNG_KEY])


class UnwrappedWorkerInfo:
    """The loader's ``worker_init_fn``, run first in every worker: ``get_worker_info()`` then
    gives the user's dataset, not the wrapper, before the user's function runs."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        if info is not None and isinstance(info.dataset, WorkerRngDataset):
            # WorkerInfo is frozen once made: a new one, as the worker loop made it
            torch_worker._worker_info = torch_worker.WorkerInfo(
                id=info.id,
                num_workers=info.num_workers,
                seed=info.seed,
                dataset=info.dataset.dataset,
            )
        if self.fn is not None:
            self.fn(worker_id)


class _WrappedIterators:
    """``loader._get_iterator`` (an instance attribute, found before the class's method):
    the iterator, and so its workers, are made with the wrapped dataset and init function;
    the loader's own attributes are put back at once."""

    def __init__(self, loader: Any) -> None:
        # weak: a cycle would leave the loader, its iterator and its workers to the garbage
        # collector, which may then run in a forked worker (and fail to stop them there)
        self.loader = weakref.ref(loader)
        self.original = type(loader)._get_iterator

    def __call__(self) -> Any:
        loader = self.loader()
        assert loader is not None  # called through the loader's attribute
        if restored_position(loader) <= 0:
            return self._make(loader)
        # It resumes a data epoch from a restored state, where the fault-free run made no
        # iterator: the seeds iter() draws (the workers' base seed, a shuffling sampler's)
        # must not move the generators they come from. The loop of a restored process makes
        # it inside a step when a generator wraps the loader (``cycle(loader)``): the draw
        # shifted torch's generator for every later step.
        own = loader.generator
        state = own.get_state() if own is not None else None
        with torch.random.fork_rng(devices=[]):
            try:
                return self._make(loader)
            finally:
                if own is not None:
                    own.set_state(state)

    def _make(self, loader: Any) -> Any:
        dataset, init = loader.dataset, loader.worker_init_fn
        if loader.num_workers == 0 or isinstance(dataset, IterableDataset):
            return self.original(loader)
        # DataLoader refuses to have ``dataset`` set once made: set beneath its __setattr__
        object.__setattr__(loader, "dataset", WorkerRngDataset(dataset))
        object.__setattr__(loader, "worker_init_fn", UnwrappedWorkerInfo(init))
        try:
            return self.original(loader)
        finally:
            object.__setattr__(loader, "dataset", dataset)
            object.__setattr__(loader, "worker_init_fn", init)


def _stateful_loader_type() -> type | None:
    module = sys.modules.get("torchdata.stateful_dataloader")
    return getattr(module, "StatefulDataLoader", None) if module is not None else None


def is_stateful_loader(obj: object) -> bool:
    kind = _stateful_loader_type()
    return kind is not None and isinstance(obj, kind)


def install(tracked: dict[str, Any]) -> None:
    """Make every tracked ``StatefulDataLoader`` with workers over a map-style dataset carry
    its workers' generator states in its state, for the iterators it makes from now on, and
    every one resume a restored data epoch without drawing from the generators (idempotent:
    a loader tracked again in a later epoch is the same object)."""
    for obj in tracked.values():
        if is_stateful_loader(obj) and not wrapped(obj):
            obj.__dict__["_get_iterator"] = _WrappedIterators(obj)


def wrapped(loader: Any) -> bool:
    """Whether ``install`` reached this loader."""
    return isinstance(vars(loader).get("_get_iterator"), _WrappedIterators)


def notes(tracked: dict[str, Any], iterators: Iterable[object]) -> list[str]:
    """The worker-side random draws a restore cannot reproduce, one sentence per loader
    (pure: ``iterators`` are the live iterators of plain torch DataLoaders with workers)."""
    out = []
    fix = (
        "draw them from a torch.Generator seeded from the sample's index and the epoch, or "
        "move them into the training step"
    )
    for name, obj in tracked.items():
        if not is_stateful_loader(obj) or obj.num_workers == 0:
            continue
        what = f"{name} (a StatefulDataLoader over a {type(obj.dataset).__name__})"
        if isinstance(obj.dataset, IterableDataset):
            out.append(
                f"random draws in the worker processes of {what} (augmentation, masking in "
                "collate_fn) are not restored: over an IterableDataset its workers start from "
                f"their seed again after a restore; use a map-style Dataset, or {fix}"
            )
            continue
        iterator = getattr(obj, "_iterator", None)
        if iterator is not None and not isinstance(
            getattr(iterator, "_dataset", None), WorkerRngDataset
        ):
            out.append(
                f"random draws in the worker processes of {what} (augmentation, masking in "
                "collate_fn) are not restored: its iterator, and so its workers, were made "
                "before ctx.track; call iter(loader) after ctx.track"
            )
    seen: set[tuple[str, int]] = set()
    for obj in iterators:
        it: Any = obj
        key = (type(it._dataset).__name__, it._num_workers)
        if key in seen:
            continue
        seen.add(key)
        out.append(
            f"a torch DataLoader over a {key[0]} iterates with {key[1]} worker "
            f"process{'es' if key[1] > 1 else ''}: "
            "random draws in them (augmentation in the dataset, masking in collate_fn) are not "
            "restored, its workers being seeded again whenever an iterator is made; use "
            "torchdata's StatefulDataLoader tracked as data (ctx.track(..., data=loader)), "
            f"or {fix}"
        )
    return out


def position(loader: Any) -> int | None:
    """How many batches the loader's current iterator has given in its data epoch (a
    restored one counts from the restored position); None without an iterator."""
    count = getattr(getattr(loader, "_iterator", None), "_num_yielded", None)
    return count if isinstance(count, int) else None


def restored_position(loader: Any) -> int:
    """Where the loader's next iterator starts: the position of the state loaded into it
    (torchdata keeps it until an iterator takes it over), else 0."""
    state = getattr(loader, "next_iter_state", None)
    if not isinstance(state, dict):
        return 0
    count = state.get("_num_yielded")
    snapshot = state.get("_snapshot")
    if count is None and isinstance(snapshot, dict):
        count = snapshot.get("_snapshot_step")
    return count if isinstance(count, int) else 0


def taken_before_loop(tracked: dict[str, Any], positions: dict[int, int]) -> list[str]:
    """Batches the code before the loop took from a tracked StatefulDataLoader (a batch
    fetched ahead, as nanoGPT does, from a loader's iterator): one sentence per loader.
    ``positions``: by loader id, where it stood when its state was restored (0 if absent)."""
    out = []
    for name, obj in tracked.items():
        now = position(obj) if is_stateful_loader(obj) else None
        taken = 0 if now is None else now - positions.get(id(obj), 0)
        if taken > 0:
            out.append(
                f"the code before the loop took {taken} batch{'es' if taken > 1 else ''} from "
                f"{name} (a StatefulDataLoader over a {type(obj.dataset).__name__}): after a "
                f"restore it takes {'them' if taken > 1 else 'it'} again, from where the "
                "committed step left the loader, and every later step trains on a batch "
                "further on than the fault-free run's; take batches inside the loop only (at "
                "the start of the step)"
            )
    return out
