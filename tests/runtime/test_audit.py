"""The first-step audit: what a loop uses but does not track is named, once, with its fix; a
loop that tracks everything gets no warning.

Each test runs one step of a small loop in this process with ``FirstStepWatch`` installed, as
``ctx.track`` does, and reads its findings at the "first snapshot" (``finish``).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from peerckpt.runtime import audit, loaders
from peerckpt.runtime.audit import PREFIX, FirstStepWatch
from peerckpt.runtime.sampler import ResumableSampler


class Wrapper:
    """A user's data object holding a ResumableSampler (tracked through the wrapper)."""

    def __init__(self) -> None:
        self.sampler = ResumableSampler(64, 0, 1, seed=1)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def _parts() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optim = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    head = torch.optim.SGD(model[2].parameters(), lr=1e-2, momentum=0.9)
    data = TensorDataset(torch.randn(32, 4))
    return {
        "model": model,
        "optim": optim,
        "head_optim": head,
        "sched": torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s)),
        "scaler": torch.amp.GradScaler("cpu"),
        "data": StatefulDataLoader(data, batch_size=4),
        "wrapper": Wrapper(),
    }


def _one_step(parts: dict[str, Any], leave_out: set[str], run: Any = None) -> list[str]:
    """Track everything but ``leave_out``, run one step through ``run`` (the model by
    default), and return the audit's findings."""
    tracked = {k: v for k, v in parts.items() if k not in leave_out}
    gc.collect()  # objects of earlier tests are not part of this loop
    watch = FirstStepWatch(tracked, audit=True)
    try:
        x = next(iter(parts["data"]))[0]
        parts["wrapper"].sampler.take(2)
        loss = (run or parts["model"])(x).sum()
        parts["scaler"].scale(loss).backward()
        for optim in (parts["optim"], parts["head_optim"]):
            parts["scaler"].step(optim)
        parts["scaler"].update()
        parts["sched"].step()
    finally:
        found = watch.finish()
    return found


def test_a_loop_that_tracks_everything_gets_no_warning() -> None:
    assert _one_step(_parts(), set()) == []


@pytest.mark.parametrize(
    ("left_out", "named"),
    [
        ("head_optim", "optimizer SGD over 2 parameter(s) (model.2.weight, model.2.bias) steps"),
        ("sched", "LR scheduler LambdaLR of optimizer AdamW over 2 parameter(s)"),
        ("scaler", "a GradScaler in use is not tracked"),
        ("data", "a StatefulDataLoader over a TensorDataset has a state_dict() but is not"),
        ("wrapper", "a ResumableSampler has a state_dict() but is not tracked"),
    ],
)
def test_an_untracked_object_of_the_loop_is_named_with_its_fix(left_out, named) -> None:
    found = _one_step(_parts(), {left_out})
    [finding] = [f for f in found if named in f]
    assert "ctx.track(" in finding
    if left_out != "head_optim":  # the SGD's parameters are still those of a tracked model
        assert len(found) == 1, found


def test_parameters_outside_every_tracked_object_are_named() -> None:
    parts = _parts()
    extra = nn.Linear(2, 3)  # runs in the step; nothing tracks it (its optimizer neither)
    found = _one_step(parts, set(), run=lambda x: extra(parts["model"](x)))
    [finding] = found
    assert "trainable parameters of a Linear (weight 3×2, bias 3)" in finding
    assert "belong to no tracked object" in finding and "ctx.track(model=model)" in finding


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_ddp_over_an_untracked_module_is_named(one_rank_group) -> None:
    """DDP wraps the whole model, but the script tracks its two halves: the DDP's buckets have
    no tracked name to be restored under."""
    parts = _parts()
    model = parts.pop("model")
    parts.update(body=model[0], head=model[2])
    ddp = DistributedDataParallel(model)
    found = _one_step(parts, set(), run=ddp)
    [finding] = found
    assert "a DistributedDataParallel over a Sequential runs, but neither it" in finding
    assert "ctx.track(model=ddp.module)" in finding


def test_a_ddp_of_a_tracked_module_is_seen_and_not_named(one_rank_group) -> None:
    parts = _parts()
    ddp = DistributedDataParallel(parts["model"])  # wrapped; the inner module is tracked
    assert _one_step(parts, set(), run=ddp) == []


def test_each_finding_is_logged_once_per_process(caplog, monkeypatch) -> None:
    monkeypatch.setattr(audit, "_WARNED", set())
    caplog.set_level(logging.WARNING, logger="peerckpt.rank")
    for _ in range(2):  # two epochs of the same script
        found = _one_step(_parts(), {"sched"})
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith(PREFIX)]
    assert warnings == [PREFIX + found[0]]


def test_the_hooks_are_gone_after_the_first_snapshot() -> None:
    parts = _parts()
    watch = FirstStepWatch(dict(parts), audit=True)
    watch.finish()
    parts["model"](torch.randn(2, 4)).sum().backward()
    parts["head_optim"].step()
    assert watch._ran == {} and watch._stepped == {}


def _ema_step(parts: dict[str, Any], ema: nn.Module, tracked: dict[str, Any]) -> list[str]:
    """One step of a loop that keeps an exponential moving average of the model in ``ema``
    (updated in place after the optimizer step, as timm's ModelEmaV2 does)."""
    gc.collect()
    watch = FirstStepWatch(tracked, audit=True)
    try:
        watch.loop_started()
        x = next(iter(parts["data"]))[0]
        parts["model"](x).sum().backward()
        parts["optim"].step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), parts["model"].parameters(), strict=True):
                e.mul_(0.9).add_(p, alpha=0.1)
    finally:
        found = watch.finish()
    return found


def test_an_ema_copy_written_in_the_step_but_not_tracked_is_named() -> None:
    import copy

    parts = _parts()
    ema = copy.deepcopy(parts["model"])
    tracked = {k: parts[k] for k in ("model", "optim", "head_optim", "data")}
    [finding] = [f for f in _ema_step(parts, ema, tracked) if "written in the step" in f]
    assert "a Sequential (4 tensor(s), 58 values)" in finding and "ctx.track(..., ema=" in finding
    # tracked, it is restored: nothing to say
    assert not [
        f for f in _ema_step(parts, ema, {**tracked, "ema": ema}) if "written in the step" in f
    ]


def test_a_module_kept_but_not_written_in_the_step_is_not_named() -> None:
    import copy

    parts = _parts()
    frozen = copy.deepcopy(parts["model"])  # a reference copy, read but never written
    tracked = {k: parts[k] for k in ("model", "optim", "head_optim", "data")}
    gc.collect()
    watch = FirstStepWatch(tracked, audit=True)
    watch.loop_started()
    x = next(iter(parts["data"]))[0]
    (parts["model"](x) - frozen(x).detach()).pow(2).sum().backward()
    parts["optim"].step()
    assert not [f for f in watch.finish() if "written in the step" in f]


def test_running_statistics_of_an_untracked_frozen_model_are_named() -> None:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).requires_grad_(False)
    parts = _parts()
    tracked = {k: parts[k] for k in ("model", "optim", "head_optim", "data")}
    gc.collect()
    watch = FirstStepWatch(tracked, audit=True)
    watch.loop_started()
    x = next(iter(parts["data"]))[0]
    (parts["model"](x).sum() + teacher(x).sum()).backward()  # train mode: BN's stats move
    parts["optim"].step()
    [finding] = [f for f in watch.finish() if "written in the step" in f]
    assert "a Sequential (7 tensor(s), 37 values)" in finding  # the teacher, named whole


def test_a_batch_taken_from_a_tracked_loader_before_the_loop_is_named() -> None:
    """nanoGPT's prefetch from a loader: the first batch taken before the loop. Counted from
    where the loader was restored to: a loader resumed at batch 5 that gave none is fine."""
    parts = _parts()
    loader = parts["data"]
    for restored, taken, named in ((0, 1, True), (0, 0, False)):
        gc.collect()
        watch = FirstStepWatch(parts, audit=True)
        batches = iter(loader)
        for _ in range(taken):
            next(batches)
        watch.loop_started({id(loader): restored})
        found = watch.finish()
        said = "the code before the loop took 1 batch from data (a StatefulDataLoader over a"
        assert any(f.startswith(said) for f in found) == named, found
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    resumed = StatefulDataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4)
    resumed.load_state_dict(loader.state_dict())  # as a restore does, at ctx.track
    at = {id(resumed): loaders.restored_position(resumed)}
    assert at[id(resumed)] == 3
    batches = iter(resumed)
    assert audit.taken_before_loop({"data": resumed}, at) == []
    next(batches)
    [found] = audit.taken_before_loop({"data": resumed}, at)
    assert "took 1 batch from data" in found


@pytest.mark.parametrize(("steps", "named"), [(False, True), (True, False)])
def test_gradients_accumulated_across_steps_are_named(steps, named) -> None:
    """One micro-batch a ctx.steps step, the optimizer stepping every few (the literal
    Accelerate loop): the first step leaves gradients no snapshot holds."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gc.collect()
    watch = FirstStepWatch({"model": model, "optim": optim}, audit=True)
    try:
        model(torch.randn(3, 4)).sum().backward()
        if steps:
            optim.step()
    finally:
        found = watch.finish()
    said = "optimizer SGD over 2 parameter(s) (model.weight, model.bias) did not step in the first"
    assert [f.startswith(said) for f in found] == ([True] if named else []), found


def test_a_plain_loaders_iterator_in_the_loop_is_named_unless_a_tracked_sampler_keeps_it() -> None:
    """A torch DataLoader keeps no position: the iterator the loop reads from starts its data
    epoch again after a restore. Not named when its sampler is tracked."""
    data = TensorDataset(torch.randn(32, 4))
    sampler = ResumableSampler(32, 0, 1, seed=1)
    for tracked_sampler in (False, True):
        loader = DataLoader(data, batch_size=4, sampler=sampler)
        it = iter(loader)
        next(it)
        tracked: dict[str, Any] = {"sampler": sampler} if tracked_sampler else {}
        gc.collect()
        watch = FirstStepWatch(tracked, audit=True)
        found = watch.finish([("it", it)])
        said = "`it` iterates a torch DataLoader over a TensorDataset, which keeps no position"
        assert sum(f.startswith(said) for f in found) == (0 if tracked_sampler else 1), found


def test_a_tracked_sampler_fed_to_loader_workers_is_named() -> None:
    """Workers take indices ahead of the step: a tracked sampler's position in a snapshot is
    ahead of it, and a restore skips the batches they had taken (the sampler is not blamed
    without workers: the test above)."""
    data = TensorDataset(torch.randn(32, 4))
    sampler = ResumableSampler(32, 0, 1, seed=1)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    it = iter(loader)
    try:
        next(it)
        gc.collect()
        found = FirstStepWatch({"sampler": sampler}, audit=True).finish([("it", it)])
    finally:
        del it
    said = "`it` iterates a torch DataLoader over a TensorDataset whose sampler is tracked, with 2"
    assert sum(f.startswith(said) for f in found) == 1, found
