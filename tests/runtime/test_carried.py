"""Values a loop carries from one step into the next in its own variables
(``runtime/carried.py``): nanoGPT's prefetched batch is read between two steps, as a snapshot
does, and written back into the loop's frame, as a restored loop's first ``next()`` does;
loop-local tensors and tracked state are left alone.

Each test loops over a stand-in for ``ctx.steps`` that makes a ``Carry`` on the loop's frame
as its first ``next()`` runs, as the runtime does.
"""

from __future__ import annotations

import dis
import itertools
import random
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from peerckpt.runtime.audit import covered_storages
from peerckpt.runtime.carried import Carry, carried_names


class Steps:
    """Yields ``range(start, n)``. ``saved[s]``: what the loop carried after step ``s``; with
    ``put``, those values are written into the loop before its first step."""

    def __init__(
        self, n: int, tracked: dict[str, Any] | None = None, put: Any = None, start: int = 0
    ) -> None:
        self.n, self.tracked, self.put, self.start = n, tracked or {}, put, start
        self.saved: dict[int, dict[str, Any]] = {}
        self.names: set[str] = set()
        self.written: list[str] = []
        self.unsaved: list[str] = []
        self.rng: torch.Tensor | None = None
        self.module_names: set[str] = set()
        self.drifted: dict[int, list[str]] = {}

    def __iter__(self) -> Iterator[int]:
        carry = Carry.at_loop_start(sys._getframe(1))
        if carry is None:
            yield from range(self.n)
            return
        self.names, self.module_names = carry.names, carry.module_names
        if self.put is not None:
            self.written = carry.put_back(self.put, self.tracked)
        try:
            for step in range(self.start, self.n):
                yield step
                self.saved[step] = carry.values(covered_storages(self.tracked), self.tracked)
                self.drifted[step] = carry.drifted()
                if step == self.start:
                    self.unsaved = carry.unsaved(self.tracked)
        finally:
            carry.close()


def get_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


def _nanogpt_loop(steps: Steps, model: torch.nn.Module) -> list[torch.Tensor]:
    """nanoGPT's shape: the first batch before the loop, each next one in the step."""
    seen = []
    X, Y = get_batch(0)
    for step in steps:
        seen.append(X)
        ((model(X) - Y) ** 2).mean().backward()
        X, Y = get_batch(step + 1)
    return seen


def test_a_prefetched_batch_is_read_between_steps_and_put_back_before_the_first() -> None:
    model = torch.nn.Linear(3, 1)
    steps = Steps(3, {"model": model})
    _nanogpt_loop(steps, model)
    assert steps.names == {"X", "Y"}
    after_1 = steps.saved[1]
    assert set(after_1) == {"X", "Y"} and torch.equal(after_1["X"], get_batch(2)[0])

    # A restored loop resuming at step 2: the code before it fetched batch 0 again; the
    # loop's first step must read the batch the fault-free run carried into step 2.
    resumed = Steps(2, {"model": model}, put=after_1)
    seen = _nanogpt_loop(resumed, model)
    assert resumed.written == ["X", "Y"]
    assert torch.equal(seen[0], get_batch(2)[0]) and torch.equal(seen[1], get_batch(1)[0])


def test_a_carried_tensor_goes_back_on_the_device_of_the_one_made_before_the_loop() -> None:
    saved = {"h": (torch.ones(2), 3)}
    steps = Steps(1, put=saved)
    h = (torch.zeros(2, device="meta"), 0)  # the code before the loop made it on "meta"
    for _ in steps:
        got = h
        h = (h[0] + 1, h[1] + 1)
    assert steps.written == ["h"]
    assert got[0].device.type == "meta" and got[1] == 3


def test_loop_local_tensors_and_tracked_state_are_not_carried() -> None:
    model = torch.nn.Linear(3, 1)
    weight = torch.zeros(3)
    steps = Steps(3, {"model": model, "weight": weight})
    loss = torch.zeros(())  # made before the loop, but written before it is read
    w = weight  # read and written in the loop, but it is tracked state
    for step in steps:
        x, y = get_batch(step)
        loss = ((model(x) - y) ** 2).mean()
        w = w.add_(step)
    assert steps.names == {"w"} and steps.saved[2] == {}
    assert loss.requires_grad


def test_the_names_come_from_the_loop_body_only() -> None:
    def loop(it: Any) -> None:
        a = b = c = 0
        for _ in it:
            print(a, c)  # read first: carried if written too
            a = 1
            b = 2  # written only: not carried
        c = b  # written after the loop: not the body's

    code = loop.__code__
    head = next(i for i in dis.get_instructions(code) if i.opname == "FOR_ITER")
    assert carried_names(code, head.offset) == {"a"}
    assert carried_names(code, 0) == set()  # not a FOR_ITER: nothing


def test_reading_and_writing_the_frame_keeps_no_value_of_the_loop_alive() -> None:
    """Reading a frame's locals before Python 3.13 leaves a snapshot of them on the frame:
    the step's tensors would outlive their step for the rest of the loop."""
    X = torch.zeros(3)
    steps = Steps(3, put={"X": torch.ones(3)})
    refs = []
    for step in steps:
        y = torch.full((3,), float(step)) + X.sum()
        refs.append(weakref.ref(y))
        X = y
    del y, X
    steps.saved.clear()  # what the stand-in kept, as a snapshot's capture would not
    assert steps.written == ["X"] and [r() for r in refs] == [None, None, None]


def test_the_loops_plain_loader_iterators_are_found_by_name() -> None:
    """What the audit judges (``runtime/audit.py``): the raw iterator of a torch DataLoader,
    not one the script wrapped (an islice that skips the batches already taken)."""
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    found: list[list[str]] = []

    def steps() -> Iterator[int]:
        carry = Carry.at_loop_start(sys._getframe(1))
        assert carry is not None
        yield 0
        found.append([n for n, _ in carry.loader_iterators()])
        carry.close()

    it = iter(loader)
    skipped = itertools.islice(iter(loader), 1, None)
    for _ in steps():
        next(it), next(skipped)
    assert found == [["it"]]


def _cycle(loader: DataLoader) -> Iterator[Any]:
    while True:
        yield from loader


def test_plain_loader_iterators_inside_generators_and_attributes_are_found() -> None:
    """lucidrains' trainers keep ``self.dl = cycle(dl)`` and draw ``next(self.dl)`` in the
    step: the DataLoader's iterator is on the generator's frame, two levels from the loop's
    ``self``. Not found, the job ended silently MISMATCH after a kill; now it is named."""
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    found: list[list[str]] = []

    class Trainer:
        def __init__(self) -> None:
            self.dl = _cycle(loader)
            self.parts = types.SimpleNamespace(it=iter(loader))

        def train(self) -> None:
            for _ in steps():
                next(self.dl), next(self.parts.it)

    def steps() -> Iterator[int]:
        carry = Carry.at_loop_start(sys._getframe(1))
        assert carry is not None
        yield 0
        found.append(sorted(n for n, _ in carry.loader_iterators()))
        carry.close()

    Trainer().train()
    assert found == [["self.dl", "self.parts.it"]]


def test_a_name_one_branch_makes_afresh_and_the_others_carry_is_carried() -> None:
    """word_language_model: ``hidden`` made afresh on the first batch of an epoch, carried
    (repackaged) otherwise; its learning rate a local float divided on a plateau."""

    def loop(it: Any, init: Any) -> None:
        hidden = init()
        lr = 20.0
        for batch in it:
            if batch == 0:
                hidden = init()
            hidden = hidden.detach() + batch
            x = hidden * 2  # written before it is read: not carried
            if x.sum() > 100:
                lr /= 4.0

    code = loop.__code__
    head = next(i for i in dis.get_instructions(code) if i.opname == "FOR_ITER")
    assert carried_names(code, head.offset) == {"hidden", "lr"}


def test_numbers_the_loop_carries_are_saved_too() -> None:
    steps = Steps(3)
    lr, seen = 20.0, torch.zeros(1)
    for step in steps:
        seen = seen + lr
        lr = lr / 4.0 if step == 1 else lr
    assert steps.saved[1] == {"lr": 5.0, "seen": steps.saved[1]["seen"]}
    assert torch.equal(steps.saved[1]["seen"], torch.tensor([40.0]))


global_step = 0  # this module's variables, as a script's (``global`` in its functions)
best_loss = 1e9
helper_scale = 1.0


def _counter_loop(steps: Steps) -> list[int]:
    """An older script's shape: a module-level step counter and best loss the loop writes."""
    global global_step, best_loss
    seen = []
    for step in steps:
        global_step += 1
        seen.append(global_step)
        best_loss = min(best_loss, 10.0 - step)
    return seen


def test_module_variables_the_loop_writes_are_carried_and_put_back(monkeypatch) -> None:
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "global_step", 0)
    monkeypatch.setattr(module, "best_loss", 1e9)
    steps = Steps(4)
    assert _counter_loop(steps) == [1, 2, 3, 4]
    assert steps.module_names == {"global_step", "best_loss"}
    assert steps.names == set()  # `seen` is made before the loop and only appended to
    assert steps.saved[1] == {"global_step": 2, "best_loss": 9.0}

    # A restored loop resuming at step 2 in this process, whose counter ran on to 4 (a
    # survivor; a replacement's would be 0): the loop must count on from step 1's 2.
    resumed = Steps(4, put=steps.saved[1], start=2)
    assert _counter_loop(resumed) == [3, 4]
    assert resumed.written == ["best_loss", "global_step"]


def _scale_down() -> None:
    global helper_scale
    helper_scale = helper_scale * 0.5


def _helper_loop(steps: Steps) -> None:
    for step in steps:
        if step == 2:
            _scale_down()


def test_a_module_variable_a_called_function_changes_is_named_once(monkeypatch) -> None:
    from peerckpt.runtime import carried

    monkeypatch.setattr(sys.modules[__name__], "helper_scale", 1.0)
    monkeypatch.setattr(carried, "_DRIFT_NAMED", set())
    steps = Steps(5)
    _helper_loop(steps)
    assert steps.module_names == set() and steps.saved[3] == {}  # not carried
    assert steps.drifted[1] == [] and steps.drifted[3] == [] and steps.drifted[4] == []
    [said] = steps.drifted[2]
    assert said.startswith("the module variable `helper_scale` changed during the loop (1.0 → 0.5)")


def _draws(generator: Any, steps: Steps) -> list[float]:
    """A loop drawing from a generator the code before it made (noise each step)."""
    out = []
    for _ in steps:
        if isinstance(generator, torch.Generator):
            out.append(torch.rand(1, generator=generator).item())
        elif isinstance(generator, random.Random):
            out.append(generator.random())
        else:
            out.append(float(generator.random()))
    return out


@pytest.mark.parametrize("kind", ["torch", "random", "numpy", "numpy-legacy"])
def test_a_generator_the_loop_draws_from_is_carried(kind: str) -> None:
    def make() -> Any:
        return {
            "torch": lambda: torch.Generator().manual_seed(5),
            "random": lambda: random.Random(5),
            "numpy": lambda: np.random.default_rng(5),
            "numpy-legacy": lambda: np.random.RandomState(5),
        }[kind]()

    steps = Steps(4)
    reference = _draws(make(), steps)
    # A restored loop resuming at step 2: the code before it made the generator afresh.
    resumed = Steps(4, put=steps.saved[1], start=2)
    assert _draws(make(), resumed) == reference[2:]
    assert resumed.written == ["generator"]


class _Trainer:
    """A trainer class whose loader holds the generator (``DataLoader(generator=g)``) and
    which draws noise from its own (``self.rng``) in the method the loop calls."""

    def __init__(self) -> None:
        self.rng = torch.Generator().manual_seed(3)
        self.loader = types.SimpleNamespace(generator=torch.Generator().manual_seed(4))

    def step(self) -> tuple[float, float]:
        return (
            torch.rand(1, generator=self.rng).item(),
            torch.rand(1, generator=self.loader.generator).item(),
        )


def _trainer_loop(trainer: _Trainer, steps: Steps) -> list[tuple[float, float]]:
    return [trainer.step() for _ in steps]


def test_generators_held_by_the_objects_the_loop_uses_are_carried() -> None:
    steps = Steps(4)
    reference = _trainer_loop(_Trainer(), steps)
    resumed = Steps(4, put=steps.saved[1], start=2)
    assert _trainer_loop(_Trainer(), resumed) == reference[2:]
    assert resumed.written == ["trainer.loader.generator", "trainer.rng"]


def test_the_process_wide_generators_are_left_to_the_snapshots_rng_state() -> None:
    steps = Steps(2)
    generator = torch.default_generator
    for _ in steps:
        torch.rand(1, generator=generator)
    assert steps.saved[0] == {}


class _Counting:
    """A trainer counting its steps in an attribute, as class-based trainers do."""

    def __init__(self, rank: int) -> None:
        self.global_step = 0
        self.rank = rank  # set before the loop, never changed by it

    def step(self) -> int:
        self.global_step += 1
        return self.global_step


def _counting_loop(trainer: _Counting, args: Any, steps: Steps) -> list[tuple[int, float]]:
    seen = []
    for step in steps:
        seen.append((trainer.step(), args.lr))
        if step == 1:
            args.lr = args.lr / 2
    return seen


def test_numbers_the_loop_changes_in_its_objects_attributes_are_carried() -> None:
    import argparse

    steps = Steps(4)
    optim = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, 1)  # torch's own counters: not carried
    reference = _counting_loop(_Counting(rank=3), argparse.Namespace(lr=0.1), steps)
    assert reference == [(1, 0.1), (2, 0.1), (3, 0.05), (4, 0.05)]
    assert not any(key.startswith("sched") for key in steps.saved[1])
    del sched
    # A replacement (another rank number) resumes at step 2 with fresh objects: the counter
    # and the halved lr come back; the rank it set before the loop stays its own.
    trainer = _Counting(rank=5)
    resumed = Steps(4, put=steps.saved[1], start=2)
    assert _counting_loop(trainer, argparse.Namespace(lr=0.1), resumed) == reference[2:]
    assert resumed.written == ["args.lr", "trainer.global_step"]
    assert trainer.rank == 5


def test_a_generator_made_in_the_step_is_not_carried() -> None:
    steps = Steps(2)
    for step in steps:
        g = torch.Generator().manual_seed(step)
        torch.rand(1, generator=g)
    assert steps.saved[0] == {}


def _tutorial_loop(steps: Steps, loader: Any, per_epoch: int) -> list[torch.Tensor]:
    """The distributed tutorial's epochs over ``ctx.steps``: a new iterator at each epoch's
    first step, made in the loop only. ``steps.rng``: torch's generator as the first step
    began."""
    seen = []
    for step in steps:
        if not seen:
            steps.rng = torch.get_rng_state()
        if step % per_epoch == 0:
            batches = iter(loader)
        seen.append(next(batches)[0])
    return seen


def test_an_iterator_of_a_tracked_stateful_loader_is_made_again_where_the_loop_left_it() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader() -> Any:
        return StatefulDataLoader(TensorDataset(torch.arange(12.0)), batch_size=2, shuffle=True)

    torch.manual_seed(0)
    fault_free = _tutorial_loop(Steps(6), loader(), per_epoch=6)
    torch.manual_seed(0)
    first = loader()
    steps = Steps(4, {"data": first})
    _tutorial_loop(steps, first, per_epoch=6)
    assert steps.names == {"batches"} and steps.unsaved == []
    assert steps.saved[3] == {"batches": {"__iterator_of__": "data"}}

    # Restored after step 3: the loader's position came back with ctx.track; the code before
    # the loop made no iterator, and the loop resumes mid-epoch (it raised UnboundLocalError).
    restored = loader()
    restored.load_state_dict(first.state_dict())
    resumed = Steps(6, {"data": restored}, put=steps.saved[3], start=4)
    before = torch.get_rng_state()  # as restored for step 4
    seen = _tutorial_loop(resumed, restored, per_epoch=6)
    assert resumed.written == ["batches"]
    assert [int(t[0]) for t in seen] == [int(t[0]) for t in fault_free[4:6]]
    # iter() drew a shuffling seed from torch's generator: the step's dropout must not see it
    assert torch.equal(resumed.rng, before)


def test_an_iterator_the_code_before_the_loop_made_after_the_restore_is_kept() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = StatefulDataLoader(TensorDataset(torch.arange(12.0)), batch_size=2)
    steps = Steps(2, {"data": data}, put={"batches": {"__iterator_of__": "data"}})
    batches = iter(data)  # already where the restored loader is: a second iter() restarts it
    made = batches
    for _ in steps:
        batch = next(batches)
        batches = made  # carried: read at the top of the next step, written in this one
    assert steps.written == [] and int(batch[0][0]) == 2


def test_a_carried_value_a_restore_cannot_bring_back_is_named() -> None:
    def numbers() -> Iterator[torch.Tensor]:
        yield from (torch.full((1,), float(i)) for i in itertools.count())

    steps = Steps(2)
    for step in steps:
        if step == 0:
            stream = numbers()
        next(stream)
    [note] = steps.unsaved
    assert note.startswith("the loop carries `stream` (a generator) from one step into the next")
    assert "UnboundLocalError" in note


def test_the_loop_that_asked_for_the_steps_is_found_through_a_wrapper_that_iterates_them() -> None:
    # `for step in tqdm(ctx.steps(n))`: tqdm's __iter__, a generator, resumes the steps, so
    # the frame above them is tqdm's. Its loop carries nothing, and nanoGPT's prefetched batch
    # was never saved: a restore resumed on batch 0, MISMATCH, nothing said.
    found: dict[str, set[str]] = {}

    def steps(made_in: list[Any]) -> Iterator[int]:  # ctx.steps's shape (runtime/api.py)
        frame = made_in.pop()
        above = Carry.at_loop_start(sys._getframe(1))
        asked = Carry.at_loop_start(made_in=frame)
        assert above is not None and asked is not None
        found["above"], found["asked"] = above.names, asked.names
        above.close()
        asked.close()
        yield from range(3)

    class Tqdm:  # tqdm's shape
        def __init__(self, iterable: Iterator[int]) -> None:
            self.iterable, self.n = iterable, 0

        def __iter__(self) -> Iterator[int]:
            for obj in self.iterable:
                yield obj
                self.n += 1

    model = torch.nn.Linear(3, 1)
    X, Y = get_batch(0)
    for step in Tqdm(steps([sys._getframe()])):
        ((model(X) - Y) ** 2).mean().backward()
        X, Y = get_batch(step + 1)
    assert found["above"] == set() and found["asked"] == {"X", "Y"}


def test_a_frame_left_inside_for_iters_inline_cache_is_at_its_for_iter() -> None:
    # Python 3.12 leaves the loop's frame at FOR_ITER's inline cache entry (f_lasti two bytes
    # on) while a generator runs: the loop was not found there, and on 3.12 nanoGPT's
    # prefetched batch was never saved (checked by hand with 3.10-3.13's interpreters).
    from peerckpt.runtime.carried import _at_for_iter, _instruction_at

    seen: dict[str, Any] = {}

    def steps() -> Iterator[int]:
        frame = sys._getframe(1)
        head = _instruction_at(frame)
        inside = _instruction_at(frame, head.offset + 1) if head else None  # as 3.12's cache
        seen["at_head"] = _at_for_iter(frame)
        seen["inside"] = inside is not None and head is not None and inside.offset == head.offset
        seen["names"] = carried_names(frame.f_code, inside.offset) if inside else set()
        del frame
        yield from range(2)

    X = 0
    for step in steps():
        X = X + step
    assert seen == {"at_head": True, "inside": True, "names": {"X"}}
