"""DCP's ``AppState``: one Stateful whose ``state_dict()`` is torch's
``get_state_dict(model, optimizer)``, tracked as one object (``ctx.track(app=AppState(...))``).

Its DTensors (an FSDP2 model's parameters and AdamW moments) are boxes of global tensors, and
come back as DTensors placed like the ones its ``state_dict()`` gives (``runtime/restore.py``);
what it holds (model, optimizers, scheduler, a DDP) is tracked for the audit and for the DDP
bucket layouts (``runtime/held.py``).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from peerckpt.errors import StateMismatch
from peerckpt.runtime import capture
from peerckpt.runtime.audit import FirstStepWatch
from peerckpt.runtime.ddp import DdpLayouts
from peerckpt.runtime.rank import _looks_like_comm_error

from .slots import restore_from_slot, snapshot
from .test_audit import one_rank_group  # noqa: F401 (the fixture every test here uses)

pytestmark = pytest.mark.usefixtures("one_rank_group")


class AppState:
    """As in the DCP tutorial (``torch.distributed.checkpoint.stateful.Stateful``)."""

    def __init__(self, model: nn.Module, optimizers: Any, sched: Any = None) -> None:
        self.model, self.optimizers, self.sched = model, optimizers, sched

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizers)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


def _fsdp_app(seed: int) -> AppState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return AppState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _train(app: AppState, steps: int) -> None:
    for _ in range(steps):
        app.model(torch.randn(4, 6)).pow(2).mean().backward()
        app.optimizers.step()
        app.optimizers.zero_grad()


def _full(app: AppState) -> list[torch.Tensor]:
    out = [p.full_tensor() for p in app.model.parameters() if isinstance(p, DTensor)]
    for state in app.optimizers.state.values():
        out += [v.full_tensor() if isinstance(v, DTensor) else v for _, v in sorted(state.items())]
    return out


def test_an_fsdp2_app_state_comes_back_as_dtensors_bit_exact() -> None:
    original = _fsdp_app(seed=0)
    _train(original, 3)
    slot, chunks = snapshot({"app": original}, step=2)
    shared = {c.key for c in chunks if c.scope == "global"}
    assert "app/model/0.weight" in shared and "app/optim/state/0.weight/exp_avg" in shared
    assert "app/optim/state/0.weight/step" not in shared  # a plain tensor: private, as before
    rng = capture.capture_rng()

    fresh = _fsdp_app(seed=7)  # a new process builds it from scratch: no optimizer state yet
    restore_from_slot({"app": fresh}, slot, chunks)
    assert all(isinstance(p, DTensor) for p in fresh.model.parameters())
    for a, b in zip(_full(original), _full(fresh), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    capture.restore_rng(rng)
    _train(original, 2)
    capture.restore_rng(rng)
    _train(fresh, 2)
    for a, b in zip(_full(original), _full(fresh), strict=True):
        assert torch.equal(a, b)


class Plain:
    """A Stateful whose state_dict() has no DTensor where the snapshot had one."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def test_a_dtensor_with_nothing_like_it_to_restore_into_is_named() -> None:
    app = _fsdp_app(seed=0)
    _train(app, 1)
    saved = app.state_dict()
    slot, chunks = snapshot({"app": Plain(saved)}, step=0)
    now = {**saved, "model": {k: v.to_local() for k, v in saved["model"].items()}}
    with pytest.raises(StateMismatch) as err:
        restore_from_slot({"app": Plain(now)}, slot, chunks)
    assert "its state_dict() holds a (12, 6) float32 DTensor at 'model/0.weight'" in str(err.value)
    assert "now holds none" in str(err.value)


def _audit(tracked: dict[str, Any], app: AppState, run: Any) -> list[str]:
    gc.collect()
    watch = FirstStepWatch(tracked, audit=True)
    try:
        run(torch.randn(4, 6)).pow(2).mean().backward()
        optims = app.optimizers if isinstance(app.optimizers, list) else [app.optimizers]
        for optim in optims:
            optim.step()
        if app.sched is not None:
            app.sched.step()
    finally:
        found = watch.finish()
    return found


def _ddp_app(optimizers: int) -> AppState:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3)))
    optims: list[torch.optim.Optimizer] = [torch.optim.AdamW(model.module[0].parameters(), lr=1e-2)]
    optims += [torch.optim.SGD(model.module[2].parameters(), lr=1e-2)][: optimizers - 1]
    sched = torch.optim.lr_scheduler.LambdaLR(optims[0], lambda s: 1 / (1 + s))
    return AppState(model, optims, sched)


def test_what_a_tracked_app_state_holds_is_tracked() -> None:
    """Model (a DDP), two optimizers and a scheduler held by the tracked AppState: no finding;
    the DDP's bucket layout is kept under the AppState's attribute path."""
    app = _ddp_app(optimizers=2)
    tracked = {"app": app}
    assert _audit(tracked, app, app.model) == []
    assert DdpLayouts(tracked).name_of(app.model) == "app.model"


def test_an_optimizer_the_app_state_does_not_hold_is_still_named() -> None:
    app = _ddp_app(optimizers=2)
    head = app.optimizers.pop()  # stepped by the loop, held by nothing tracked
    app.optimizers.append(head)
    tracked = {"app": AppState(app.model, app.optimizers[:1], app.sched)}
    [finding] = _audit(tracked, app, app.model)
    assert finding.startswith("optimizer SGD over 2 parameter(s)")


def test_fsdp1_and_zero_are_refused_by_name_even_inside_an_app_state() -> None:
    """What a restore would silently get wrong is refused at ctx.track (measured: an FSDP1
    job's first step after a restore already differed, with nothing said)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from peerckpt.runtime.tracking import refuse_unsupported

    net = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    fsdp1 = FullyShardedDataParallel(net, device_id=torch.device("cpu"))
    with pytest.raises(StateMismatch, match=r"app\.model is \(or holds\) a FullyShardedDataPa"):
        refuse_unsupported("app", AppState(fsdp1, torch.optim.SGD(fsdp1.parameters(), lr=0.1)))
    plain = nn.Linear(6, 3)
    zero = ZeroRedundancyOptimizer(plain.parameters(), optimizer_class=torch.optim.AdamW)
    with pytest.raises(StateMismatch, match="optim is a ZeroRedundancyOptimizer") as refused:
        refuse_unsupported("optim", zero)
    # Failed at once: "peerckpt" in the refusal read as a collective's "peer" made the job
    # wait out the suspect window (30 s) for an abort notice that never came.
    assert not _looks_like_comm_error(refused.value)
    refuse_unsupported("app", _fsdp_app(seed=0))  # FSDP2: nothing to refuse
