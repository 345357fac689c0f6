"""Which tracked objects cannot follow a change of world size (``runtime/reshardable.py``):
data loaders and samplers without ``load_resharded_state``, also held inside a user's object;
models, optimizers, schedulers and ``peerckpt.ResumableSampler`` are not named."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from peerckpt.errors import NotReshardable
from peerckpt.runtime.reshardable import refusal, unreshardable
from peerckpt.runtime.sampler import ResumableSampler

DATA = TensorDataset(torch.arange(64.0).view(32, 2))


class Batches:
    """A user's object holding a loader, without ``load_resharded_state``."""

    def __init__(self) -> None:
        self.loader = StatefulDataLoader(DATA, batch_size=4)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class Resharded(Batches):
    """The same, with the protocol: it decides itself."""

    def load_resharded_state(self, states: list[dict[str, Any]], rank: int, world: int) -> None:
        pass


def test_a_stateful_loader_over_a_distributed_sampler_is_named_with_its_sampler() -> None:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=True, seed=3)
    loader = StatefulDataLoader(DATA, batch_size=4, sampler=sampler)
    model = torch.nn.Linear(2, 1)
    optim = torch.optim.AdamW(model.parameters())
    tracked = {
        "model": model,
        "optim": optim,
        "sched": torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0),
        "data": loader,
    }
    assert unreshardable(tracked) == ["data (a StatefulDataLoader with a DistributedSampler)"]


def test_a_loader_inside_a_users_object_is_named_unless_it_reshards_itself() -> None:
    found = unreshardable({"batches": Batches(), "mine": Resharded()})
    assert found == ["batches (a Batches holding a StatefulDataLoader with a SequentialSampler)"]


def test_the_resumable_sampler_and_plain_state_are_not_named() -> None:
    tracked = {
        "sampler": ResumableSampler(32, 0, 2, seed=1),
        "weights": torch.zeros(3),
        "scaler": torch.amp.GradScaler("cpu"),
    }
    assert unreshardable(tracked) == []


def test_the_refusal_names_the_objects_and_the_fix() -> None:
    text = refusal(["data (a StatefulDataLoader with a DistributedSampler)"])
    assert "data (a StatefulDataLoader with a DistributedSampler)" in text
    assert NotReshardable.FIX in text and "peerckpt.ResumableSampler" in text
