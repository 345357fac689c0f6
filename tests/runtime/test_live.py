"""A survivor restores from its live tensors without copying, and only when they hold the step.

``LiveState`` records, at each snapshot, which tensors are the live ones and the step they
hold; an optimizer step makes them unknown. A restore in the same topology then points the
new objects' parameters at those tensors and gives the new optimizer the old state tensors:
no byte is copied, and the result equals a restore from the slot bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from peerckpt.runtime import capture, live, restore

from .slots import snapshot
from .test_restore import _assert_same, _state, _step


def _objects(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": optim, "ema": torch.full((5,), float(seed))}


def _restore(objs: dict, slot: torch.Tensor, chunks: list, usable: tuple[dict, bool]) -> int:
    meta = restore.read_meta(slot, chunks[-1])
    source = restore.ChunkSource(chunks, slot=slot)
    alive, clean = usable
    return restore.restore_objects(
        objs, objs, source, {0: meta}, 0, 0, 1, resharded=False, alive=alive, clean=clean
    )


def _captured_state(old: dict, step: int) -> tuple[live.LiveState, torch.Tensor, list]:
    state = live.LiveState()
    captured = capture.capture(old, step, {})
    state.captured(0, 1, step, captured)
    slot, chunks = snapshot(old, step)
    return state, slot, chunks


def test_a_survivor_adopts_its_live_tensors_and_copies_nothing() -> None:
    old = _objects()
    _step(old)
    state, slot, chunks = _captured_state(old, step=1)
    expected = _state(old)
    pointers = {id(p): p.data_ptr() for p in old["model"].parameters()}
    old_params = list(old["model"].parameters())
    old_state = [v for s in old["optim"].state.values() for v in s.values()]
    old["model"](torch.randn(4, 6))  # the next step's forward: BatchNorm's buffers move on
    new = _objects(seed=1)  # the function runs again and builds new objects
    adopted = _restore(new, slot, chunks, state.usable(0, 1, 1))
    _assert_same(_state(new), expected)
    new_params = list(new["model"].parameters())
    for p_old, p_new in zip(old_params, new_params, strict=True):
        assert p_new.data_ptr() == pointers[id(p_old)], "a parameter was copied, not adopted"
    new_state = [v for s in new["optim"].state.values() for v in s.values()]
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(old_state, new_state, strict=True))
    params = sum(p.numel() * 4 for p in old_params)
    assert adopted == 3 * params + 4 * len(old_params)  # weights, both moments, the steps
    # buffers were cloned at capture (they change in forward): copied from the slot
    assert new["model"][1].running_mean.data_ptr() != old["model"][1].running_mean.data_ptr()


def test_after_an_optimizer_step_the_slot_is_copied_into_the_old_tensors() -> None:
    old = _objects()
    _step(old)
    state, slot, chunks = _captured_state(old, step=1)
    expected = _state(old)
    state.dirty()  # what the optimizer pre-hook says before the step runs
    _step(old)
    assert any(not torch.equal(v, expected[k]) for k, v in _state(old).items())
    alive, clean = state.usable(0, 1, 1)
    assert alive and not clean
    pointers = [p.data_ptr() for p in old["model"].parameters()]
    new = _objects(seed=1)
    assert _restore(new, slot, chunks, (alive, clean)) == 0  # every byte copied
    _assert_same(_state(new), expected)
    assert [p.data_ptr() for p in new["model"].parameters()] == pointers  # into touched memory


def test_live_tensors_serve_only_the_rank_and_world_they_belong_to() -> None:
    old = _objects()
    _step(old)
    state, _, _ = _captured_state(old, step=1)
    assert state.usable(0, 1, 2)[1] is False  # another step: kept, to be copied into
    assert state.usable(0, 1, 1)[1] is True
    assert state.usable(1, 1, 1) == ({}, False)  # another rank: forgotten
    assert state.usable(0, 1, 1) == ({}, False)
    state, _, _ = _captured_state(old, step=1)
    assert state.usable(0, 2, 1) == ({}, False)
    state, _, _ = _captured_state(old, step=1)
    state.keep_for(0, 1, None)  # the next epoch restores nothing in the same topology
    assert state.usable(0, 1, 1) == ({}, False)


def test_a_view_into_a_larger_buffer_is_copied_into_never_re_pointed() -> None:
    flat = torch.zeros(40)
    owner = nn.Parameter(flat[8:24].view(4, 4))  # as FSDP2's padded shards are
    value = torch.arange(16.0).view(4, 4)
    assert not live.adopt(owner, value)
    assert owner.data_ptr() == flat[8:].data_ptr()
    plain = nn.Parameter(torch.zeros(4, 4))
    assert not live.adopt(plain, value.t())  # another layout
    assert not live.adopt(plain, value.double())
    assert live.adopt(plain, value) and plain.data_ptr() == value.data_ptr()
    assert plain.requires_grad and plain.is_leaf


def test_an_adopted_parameter_keeps_its_gradient_hooks() -> None:
    # DDP's reducer all-reduces from hooks on each parameter's gradient accumulator, set when
    # the DDP is built — before ``ctx.track`` adopts the live tensors. Adopting must keep
    # that accumulator, or the restored rank trains alone without a word (a spare beside it
    # then waits in the all-reduce forever).
    param = nn.Parameter(torch.ones(4))
    accumulator = param.view_as(param).grad_fn.next_functions[0][0]
    fired: list[int] = []
    accumulator.register_hook(lambda *args: fired.append(1))
    kept = torch.full((4,), 3.0)
    assert live.adopt(param, kept)
    assert param.data_ptr() == kept.data_ptr()  # no byte copied
    (param * 2).sum().backward()
    assert fired == [1] and torch.equal(param.grad, torch.full((4,), 2.0))
