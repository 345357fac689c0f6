"""A restore writes every tracked tensor back, however it changed after the snapshot.

A survivor re-tracks objects that may have moved on since the committed snapshot, and some
ways of changing a tensor leave ``Tensor._version`` as it was (measured on torch 2.13: writes
through ``.data``, through a numpy view, and BatchNorm's running statistics). A restore that
skipped tensors whose version had not moved would keep those changes; these tests make sure
every path comes back bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

from .slots import restore_from_slot, snapshot


def _objects() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": optim, "ema": torch.zeros(5)}


def _step(objs: dict) -> None:
    objs["model"](torch.randn(4, 6)).pow(2).mean().backward()
    objs["optim"].step()
    objs["optim"].zero_grad()


def _state(objs: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the tracked objects, cloned, by name."""
    out = {f"model/{k}": v.clone() for k, v in objs["model"].state_dict().items()}
    for i, (param, state) in enumerate(objs["optim"].state.items()):
        assert isinstance(param, torch.Tensor)
        for k, v in state.items():
            out[f"optim/{i}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    out["ema"] = objs["ema"].clone()
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, key
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (
                key
            )
        else:
            assert x == y, key


def _in_place(objs: dict) -> None:
    with torch.no_grad():
        objs["model"][0].weight.add_(1.0)


def _through_data(objs: dict) -> None:
    objs["model"][0].weight.data.mul_(3.0)
    objs["ema"].data.fill_(7.0)


def _through_numpy(objs: dict) -> None:
    objs["model"][2].bias.detach().numpy()[:] = 5.0


def _batchnorm_forward(objs: dict) -> None:
    objs["model"].train()
    with torch.no_grad():
        objs["model"](torch.randn(4, 6) * 10)


def _optimizer_step(objs: dict) -> None:
    _step(objs)


def _replaced_parameter(objs: dict) -> None:
    objs["model"][2].weight = nn.Parameter(torch.randn(3, 8))
    objs["optim"].param_groups[0]["params"][4] = objs["model"][2].weight


MUTATIONS: dict[str, Callable[[dict], None]] = {
    "in place under no_grad": _in_place,
    "through .data": _through_data,
    "through a numpy view": _through_numpy,
    "BatchNorm running statistics": _batchnorm_forward,
    "optimizer step": _optimizer_step,
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_restore_undoes_every_change_to_the_same_objects(name: str) -> None:
    objs = _objects()
    _step(objs)
    slot, chunks = snapshot(objs, step=1)
    expected = _state(objs)
    MUTATIONS[name](objs)
    assert any(not torch.equal(v, expected[k]) for k, v in _state(objs).items() if k in expected), (
        f"{name} changed nothing: the test would prove nothing"
    )
    restore_from_slot(objs, slot, chunks)
    _assert_same(_state(objs), expected)


def test_restore_into_a_replaced_parameter() -> None:
    objs = _objects()
    _step(objs)
    slot, chunks = snapshot(objs, step=1)
    expected = _state(objs)
    _replaced_parameter(objs)
    restore_from_slot(objs, slot, chunks)
    _assert_same(_state(objs), expected)


def test_restore_drops_optimizer_state_created_after_the_snapshot() -> None:
    objs = _objects()
    slot, chunks = snapshot(objs, step=1)  # no optimizer state yet: it is created lazily
    expected = _state(objs)
    _step(objs)
    assert len(objs["optim"].state) > 0
    restore_from_slot(objs, slot, chunks)
    assert len(objs["optim"].state) == 0
    _assert_same(_state(objs), expected)


def test_restore_into_fresh_objects_matches_the_snapshot() -> None:
    objs = _objects()
    _step(objs)
    slot, chunks = snapshot(objs, step=1)
    expected = _state(objs)
    fresh = _objects()  # a survivor builds its objects again in the new epoch
    restore_from_slot(fresh, slot, chunks)
    _assert_same(_state(fresh), expected)


def test_a_distributed_samplers_epoch_comes_back_with_its_loader() -> None:
    """The loop sets the DistributedSampler's epoch at each data epoch's first step; the
    restored loader, made again before the loop with epoch 0, must go on in the saved epoch's
    order (torchdata saves how far the sampler's iterator got, not the epoch it ran in)."""
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(64))

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(data, batch_size=4, sampler=DistributedSampler(data, 2, 1))

    running = loader()
    running.sampler.set_epoch(3)
    batches = iter(running)
    next(batches)
    slot, chunks = snapshot({"data": running}, step=7)
    expected = [next(batches).tolist() for _ in range(3)]

    fresh = loader()  # the code before the loop, again: epoch 0
    meta = restore_from_slot({"data": fresh}, slot, chunks)
    assert meta["sampler_epochs"] == {"data": 3} and fresh.sampler.epoch == 3
    again = iter(fresh)
    assert [next(again).tolist() for _ in range(3)] == expected
