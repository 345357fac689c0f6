"""Values a loop carries from one step into the next without tracking them
(``runtime/carried.py``): nanoGPT's prefetched batch is named, loop-local tensors and tracked
state are not.

Each test runs a loop over a stand-in for ``ctx.steps`` that starts a ``CarriedWatch`` on the
loop's frame as its first ``next()`` runs, and finishes it after the first step, as the
runtime does at the first snapshot.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from peerckpt.runtime.carried import CarriedWatch, carried_names


class Steps:
    """Yields ``range(n)``; ``found`` holds the watch's findings after the first step."""

    def __init__(self, n: int, tracked: dict[str, Any] | None = None) -> None:
        self.n, self.tracked = n, tracked or {}
        self.found: list[str] | None = None

    def __iter__(self) -> Iterator[int]:
        watch = CarriedWatch.at_loop_start(self.tracked, sys._getframe(1))
        for step in range(self.n):
            yield step
            if step == 0:
                self.found = watch.finish() if watch is not None else []


def get_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


def test_a_batch_fetched_before_the_loop_and_again_at_the_end_of_each_step_is_named() -> None:
    model = torch.nn.Linear(3, 1)
    steps = Steps(3, {"model": model})
    X, Y = get_batch(0)  # nanoGPT's names
    for step in steps:
        loss = ((model(X) - Y) ** 2).mean()
        loss.backward()
        X, Y = get_batch(step + 1)
    assert steps.found is not None and len(steps.found) == 1
    text = steps.found[0]
    assert text.startswith("`X`, `Y` hold tensors made before the loop")
    assert "fetch them at the start of the step" in text


def test_a_batch_fetched_in_the_step_and_loop_local_tensors_are_not_named() -> None:
    model = torch.nn.Linear(3, 1)
    steps = Steps(3, {"model": model})
    loss = torch.zeros(())  # made before the loop, but written before it is read
    for step in steps:
        x, y = get_batch(step)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
    assert steps.found == []


def test_a_tracked_tensor_updated_in_place_is_not_named() -> None:
    weight = torch.zeros(3)
    steps = Steps(3, {"weight": weight})
    for step in steps:
        weight.add_(step)
    assert steps.found == []


def test_a_carried_value_that_keeps_its_object_is_not_named() -> None:
    buffer = torch.zeros(3)
    steps = Steps(3)
    for step in steps:
        buffer = buffer.add_(step)  # read, then bound again to the same object
    assert steps.found == []


def test_the_names_come_from_the_loop_body_only() -> None:
    def loop(it: Any) -> None:
        a = b = c = 0
        for _ in it:
            print(a, c)  # read first: carried if written too
            a = 1
            b = 2  # written only: not carried
        c = b  # written after the loop: not the body's

    code = loop.__code__
    head = next(i for i in __import__("dis").get_instructions(code) if i.opname == "FOR_ITER")
    assert carried_names(code, head.offset) == {"a"}
    assert carried_names(code, 0) == set()  # not a FOR_ITER: nothing


def test_the_watch_keeps_no_value_of_the_loop_alive() -> None:
    """Reading a frame's locals before Python 3.13 leaves a snapshot of them on the frame:
    the step's tensors would outlive their step for the rest of the loop."""
    X = torch.zeros(3)  # a candidate: the watch reads the frame twice
    steps = Steps(3)
    refs = []
    for step in steps:
        y = torch.full((3,), float(step)) + X.sum()
        refs.append(weakref.ref(y))
        X = y
    del y, X
    assert steps.found is not None and len(steps.found) == 1
    assert [r() for r in refs] == [None, None, None]
