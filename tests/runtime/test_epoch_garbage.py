"""What an epoch's function built is freed before the function runs again."""

from __future__ import annotations

import gc
import types
import weakref

import torch

from peerckpt.runtime import rank as rank_mod
from peerckpt.runtime.audit import FirstStepWatch
from peerckpt.runtime.tracking import EpochTracking


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.me = self  # a cycle, as a module's hooks or an exception's frames make one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_leaving_an_epoch_lets_go_of_what_the_function_tracked() -> None:
    model = _Model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gone, optim_gone = weakref.ref(model), weakref.ref(optim)
    tracked = {"model": model, "optim": optim}
    watch = FirstStepWatch(tracked, audit=False)  # it keeps the optimizers that stepped
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    hooks: list[torch.utils.hooks.RemovableHandle] = []
    hooks.append(model.register_forward_hook(lambda *a: None))
    tracking = types.SimpleNamespace(
        _hooks=hooks, tracked=tracked, _restored={"m": 1}, _carried={"x": model}, _watch=watch
    )
    del model, optim
    EpochTracking.close(tracking)
    assert tracked == {} and tracking._restored is None and tracking._watch is None
    del watch
    gc.collect()
    assert gone() is None and optim_gone() is None


def test_on_a_gpu_the_last_epochs_cycles_are_collected_before_the_next_call(monkeypatch) -> None:
    gc.collect()
    gc.disable()  # no automatic pass may free it first
    try:
        model = _Model()
        gone = weakref.ref(model)
        del model  # unreachable, held by its own cycle
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        rank_mod._free_last_epoch()
        assert gone() is not None  # on CPU the collector's own pass frees it, later
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        rank_mod._free_last_epoch()
        assert gone() is None
    finally:
        gc.enable()
