"""Capture and restore: every kind of tracked state comes back bit for bit."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

from peerckpt.errors import StateMismatch
from peerckpt.runtime import capture, restore

from .slots import restore_from_slot, snapshot


class Loader:
    """A Stateful with nested state, tuples and a tensor."""

    def __init__(self) -> None:
        self.pos, self.order, self.buffer = 0, (3, 1, 2), torch.zeros(4)

    def state_dict(self) -> dict:
        return {"pos": self.pos, "meta": {"order": self.order, "name": "x"}, "buffer": self.buffer}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.order, self.buffer = state["pos"], state["meta"]["order"], state["buffer"]


def _objects(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched, "data": Loader(), "ema": torch.zeros(3)}


def _train(objs: dict, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(5, 8)
        objs["model"](x).pow(2).mean().backward()
        objs["optim"].step()
        objs["optim"].zero_grad()
        objs["sched"].step()
        objs["data"].pos += 5
        objs["data"].buffer += 1
        objs["ema"].mul_(0.9).add_(torch.rand(3))


def _same(a: dict, b: dict) -> None:
    for (ka, ta), (kb, tb) in zip(
        a["model"].state_dict().items(), b["model"].state_dict().items(), strict=True
    ):
        assert ka == kb and ta.dtype == tb.dtype and torch.equal(ta, tb)
    sa, sb = a["optim"].state_dict(), b["optim"].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k])
    assert a["sched"].state_dict() == b["sched"].state_dict()
    assert a["data"].pos == b["data"].pos and a["data"].order == b["data"].order
    assert torch.equal(a["data"].buffer, b["data"].buffer) and torch.equal(a["ema"], b["ema"])


def test_restore_reproduces_every_object_and_training_continues_bit_exact() -> None:
    original = _objects(seed=0)
    _train(original, 3)
    slot, chunks = snapshot(original, step=2)
    rng_after_capture = capture.capture_rng()

    restored = _objects(seed=99)  # a fresh process would build these from scratch
    meta = restore_from_slot(restored, slot, chunks)
    assert meta["step"] == 2
    _same(original, restored)
    assert isinstance(restored["data"].order, tuple)

    capture.restore_rng(rng_after_capture)
    _train(original, 3)
    capture.restore_rng(meta["rng"])
    _train(restored, 3)
    _same(original, restored)


def test_restored_optimizer_state_does_not_alias_the_slot() -> None:
    objs = _objects(seed=0)
    _train(objs, 1)
    slot, chunks = snapshot(objs, step=0)
    fresh = _objects(seed=1)
    restore_from_slot(fresh, slot, chunks)
    before = slot.clone()
    _train(fresh, 2)  # must not write into the committed snapshot
    assert torch.equal(slot, before)


def test_restore_from_a_file_reads_each_chunk_into_place(tmp_path) -> None:
    # A staging segment is read with preadv, not mapped; the result must be the same bits.
    original = _objects(seed=0)
    _train(original, 3)
    slot, chunks = snapshot(original, step=2)
    path = tmp_path / "slot"
    path.write_bytes(slot.numpy().tobytes())
    restored = _objects(seed=99)
    fd = os.open(path, os.O_RDONLY)
    try:
        source = restore.ChunkSource(chunks, fd=fd)
        meta = restore.decode_meta(source._bytes(chunks[-1]))
        restore.restore_objects(restored, restored, source, {0: meta}, 0, 0, 1, resharded=False)
    finally:
        os.close(fd)
    _same(original, restored)
    path.write_bytes(slot.numpy().tobytes()[: chunks[0].byte_offset + 3])  # cut short
    other = _objects(seed=5)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(StateMismatch, match="ends inside chunk"):
            restore.restore_objects(
                other,
                other,
                restore.ChunkSource(chunks, fd=fd),
                {0: meta},
                0,
                0,
                1,
                resharded=False,
            )
    finally:
        os.close(fd)


def test_rng_states_round_trip() -> None:
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    state = capture.capture_rng()
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    capture.restore_rng(state)
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]


def test_optimizer_state_is_keyed_by_parameter_name() -> None:
    objs = _objects(seed=0)
    _train(objs, 1)
    captured = capture.capture(objs, 0, {})
    keys = [t.key for t in captured.tensors if t.key.startswith("optim/")]
    assert "optim/state/model.0.weight/exp_avg" in keys
    assert not any(k.startswith("optim/state/0/") for k in keys)


def test_an_optimizer_without_its_model_is_refused_with_the_fix() -> None:
    objs = _objects(seed=0)
    _train(objs, 1)
    with pytest.raises(StateMismatch, match=r"ctx.track\(model=model, optim=optim\)"):
        capture.capture({"optim": objs["optim"]}, 0, {})


def test_untrackable_objects_are_refused_by_name() -> None:
    with pytest.raises(StateMismatch, match=r"ctx.track\(thing=…\) got a object"):
        capture.capture({"thing": object()}, 0, {})

    class Bad:
        def state_dict(self):
            return {"f": lambda: 1}

        def load_state_dict(self, s):
            pass

    with pytest.raises(StateMismatch, match="cannot snapshot a function at 'bad/f'"):
        capture.capture({"bad": Bad()}, 0, {})


def test_restoring_into_a_different_model_is_a_clear_error() -> None:
    objs = _objects(seed=0)
    slot, chunks = snapshot({"model": objs["model"]}, step=0)
    with pytest.raises(StateMismatch, match="tracked module 'model' does not match"):
        restore_from_slot({"model": nn.Linear(8, 4)}, slot, chunks)
    with pytest.raises(StateMismatch, match="does not have"):
        restore_from_slot({"other": nn.Linear(8, 4)}, slot, chunks)


def test_a_module_wrapped_in_ddp_in_one_process_only_is_named_as_such() -> None:
    keys = ["0.weight", "0.bias"]
    hint = restore._wrapping_hint(keys, [f"module.{k}" for k in keys])
    assert "snapshot's module was wrapped in DistributedDataParallel, this one is not" in hint
    hint = restore._wrapping_hint([f"module.{k}" for k in keys], keys)
    assert "was not wrapped in DistributedDataParallel, this one is" in hint
    assert restore._wrapping_hint(["a"], ["b"]) == ""  # another mismatch: no such claim
