"""What an epoch's function built is freed before the function runs again."""

from __future__ import annotations

import gc
import types
import weakref

import torch

from peerckpt.runtime import rank as rank_mod
from peerckpt.runtime.tracking import EpochTracking


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.me = self  # a cycle, as a module's hooks or an exception's frames make one


def test_leaving_an_epoch_lets_go_of_what_the_function_tracked() -> None:
    model = _Model()
    gone = weakref.ref(model)
    hooks: list[torch.utils.hooks.RemovableHandle] = []
    hooks.append(model.register_forward_hook(lambda *a: None))
    tracking = types.SimpleNamespace(
        _hooks=hooks, tracked={"model": model}, _restored={"m": 1}, _carried={"x": model}
    )
    watch_view = tracking.tracked  # the epoch's watch and audit hold the same dict
    del model
    EpochTracking.close(tracking)
    assert watch_view == {} and tracking._restored is None and tracking._carried is None
    gc.collect()
    assert gone() is None


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
