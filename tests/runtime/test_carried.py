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
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from peerckpt.runtime.audit import covered_storages
from peerckpt.runtime.carried import Carry, carried_names


class Steps:
    """Yields ``range(n)``. ``saved[s]``: what the loop carried after step ``s``; with
    ``put``, those values are written into the loop before its first step."""

    def __init__(self, n: int, tracked: dict[str, Any] | None = None, put: Any = None) -> None:
        self.n, self.tracked, self.put = n, tracked or {}, put
        self.saved: dict[int, dict[str, Any]] = {}
        self.names: set[str] = set()
        self.written: list[str] = []

    def __iter__(self) -> Iterator[int]:
        carry = Carry.at_loop_start(sys._getframe(1))
        if carry is None:
            yield from range(self.n)
            return
        self.names = carry.names
        if self.put is not None:
            self.written = carry.put_back(self.put)
        try:
            for step in range(self.n):
                yield step
                self.saved[step] = carry.values(covered_storages(self.tracked))
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
