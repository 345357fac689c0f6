"""What the runtime learns of the user's loop in an epoch's first step, and what it says about
what it cannot make exact.

A training script arranges the standard pieces in many ways; the runtime restores exactly what
it is given with ``ctx.track`` and nothing else. Two global torch hooks, installed by the first
``ctx.track`` of an epoch and removed at its first snapshot, show what the loop actually uses:

- a module forward pre-hook: every ``DistributedDataParallel`` that runs a forward (handed to
  ``DdpLayouts``, which restores its bucket layout before that forward runs, tracked or not,
  then to ``release_on_abort``, which routes its gradient all-reduce through a future an abort
  can end: ``runtime/inflight.py``), and, when auditing, every module with parameters that
  runs;
- an optimizer step post-hook: every optimizer that steps.

When auditing (once per process), the first snapshot then checks what would make a restored
run differ from a fault-free one and logs one warning per finding, naming the object and the
fix: an optimizer that steps but is not tracked; a tracked optimizer that did not step though
the step left gradients in its parameters (gradients accumulated across steps: no snapshot
holds them; not judged where a GradScaler may have skipped the step); an LR scheduler or GradScaler of the loop
that is not tracked; a data loader or sampler with ``state_dict`` that no tracked object
holds; parameters of modules that ran but belong to no tracked object; a DDP whose module is
not tracked (its buckets cannot be restored); modules whose parameters or buffers no
tracked object holds and that the step wrote in place (an EMA copy of the model); batches the
code before the loop took from a tracked loader's iterator (fetched ahead: the loop's carried
batch is saved, ``runtime/carried.py``, but after a restore the loader gives it again);
random draws in
data-loader workers that a restore cannot reproduce (``runtime/loaders.py``: a plain
``DataLoader`` iterating with workers, a tracked ``StatefulDataLoader`` over an
``IterableDataset`` or whose iterator was made before ``ctx.track``). Loaders,
schedulers and scalers are found with one walk of the garbage collector's objects, which is
why the audit runs once per process.

This module never raises for a finding, never changes a user object (``DdpLayouts`` applies
recorded layouts; ``release_on_abort`` gives a DDP a communication hook that computes what its
own all-reduce would, bit for bit), and costs nothing after the first step of an epoch.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from peerckpt.runtime.capture import param_fqns
from peerckpt.runtime.ddp import DdpLayouts
from peerckpt.runtime.held import held
from peerckpt.runtime.inflight import release_on_abort
from peerckpt.runtime.layouts import FlatShard, Shard, local_of
from peerckpt.runtime.loaders import notes, stateful, taken_before_loop

log = logging.getLogger("peerckpt.rank")

PREFIX = "not exact after a restore: "
_WARNED: set[str] = set()  # findings already logged by this process


class FirstStepWatch:
    """The global hooks of one epoch's first step (``remove`` is idempotent)."""

    def __init__(self, tracked: dict[str, Any], audit: bool) -> None:
        self.tracked = tracked
        self.ddp = DdpLayouts(tracked)
        self.audit = audit
        self._ddps: dict[int, DistributedDataParallel] = {}
        self._ran: dict[int, torch.nn.Module] = {}
        self._stepped: dict[int, torch.optim.Optimizer] = {}
        self._taken: list[str] = []  # batches taken from tracked loaders before the loop
        self._versions: Versions = {}
        self._modules: list[torch.nn.Module] = []
        self._handles = [
            register_module_forward_pre_hook(self._on_forward),
            register_optimizer_step_post_hook(self._on_step),
        ]

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, DistributedDataParallel):
            self._ddps.setdefault(id(module), module)
            self.ddp.see(module)  # may re-create its reducer: the hook goes on afterwards
            release_on_abort(module)
        elif self.audit and module._parameters:
            self._ran.setdefault(id(module), module)

    def _on_step(self, optim: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._stepped.setdefault(id(optim), optim)

    def loop_started(self, positions: dict[int, int] | None = None) -> None:
        """The loop over ``ctx.steps`` begins (called from its generator): when auditing,
        note the batches the code before it took from tracked loaders (``positions``: where
        each loader was when its state was restored, by id), and the versions of the tensors
        of every module no tracked object covers (an EMA copy of the model)."""
        if self.audit:
            self._taken = taken_before_loop(self.tracked, positions or {})
            self._versions, self._modules = module_versions(self.tracked, gc.get_objects())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._versions, self._modules = {}, []  # and these, the user's modules

    def finish(
        self, iterators: list[tuple[str, Any]] | None = None, notes: list[str] | None = None
    ) -> list[str]:
        """Stop watching; when auditing, log each new finding once (``notes``: found by the
        caller) and return them all."""
        taken, self._taken = self._taken, []
        versions, modules = self._versions, self._modules
        self.remove()
        if not self.audit:
            return []
        found = findings(
            self.tracked,
            [d for d in self._ddps.values() if self.ddp.name_of(d) is None],
            list(self._ran.values()),
            list(self._stepped.values()),
            gc.get_objects(),
            iterators or [],
        )
        found += taken
        found += changed_modules(versions, set(self._ran), modules)
        found += notes or []
        for text in found:
            if text not in _WARNED:
                _WARNED.add(text)
                log.warning("%s%s", PREFIX, text)
        return found


def warn_untracked() -> None:
    """``ctx.steps`` with nothing tracked takes no snapshot (``runtime/tracking.py``), which
    the job's summary reports as NOT PROTECTED: say why, once per process."""
    text = (
        "ctx.steps runs with nothing tracked: no snapshot is taken, and a failure starts the "
        "function again from its first step; call ctx.track(model=…, optim=…) before the loop"
    )
    if text not in _WARNED:
        _WARNED.add(text)
        log.warning("%s", text)


def findings(
    tracked: dict[str, Any],
    unseen_ddps: list[DistributedDataParallel],
    ran: list[torch.nn.Module],
    stepped: list[torch.optim.Optimizer],
    heap: Iterable[object],
    loop_iterators: list[tuple[str, Any]] | None = None,
) -> list[str]:
    """What of the loop a restore cannot reproduce, one sentence per object (pure: ``heap`` is
    every live object to search for schedulers, scalers and loaders; ``loop_iterators``: the
    loop's variables that hold a plain torch DataLoader's iterator, by name)."""
    holds = held(tracked)  # what tracked Stateful objects hold (DCP's AppState) is tracked
    ids = {id(obj) for obj in tracked.values()} | set(holds)
    names = param_fqns(tracked)
    out = [_ddp_finding(d) for d in unseen_ddps]
    for optim in stepped:
        if id(optim) not in ids:
            out.append(
                f"{_optim_name(optim, names)} steps but is not tracked: its state (moments, "
                "step counts, learning rates) starts again after a restore; track it, e.g. "
                "ctx.track(..., optim=optimizer)"
            )
    in_use = {id(o) for o in stepped} | {
        id(o) for o in tracked.values() if isinstance(o, torch.optim.Optimizer)
    }
    iterators: list[object] = []  # of plain DataLoaders with workers
    kinds: dict[type, str] = {}  # one classification per type: the heap is large
    scaling = False  # a GradScaler may have skipped an optimizer's step
    for obj in heap:
        kind = type(obj)  # never isinstance: some objects warn when their __class__ is read
        what = kinds.get(kind)
        if what is None:
            what = kinds[kind] = _classify(kind)
        if what == "scaler":
            scaling = scaling or cast(torch.amp.GradScaler, obj).is_enabled()
        if not what or id(obj) in ids:
            continue
        if what == "workers":
            iterators.append(obj)
        elif what == "scheduler":
            sched = cast(torch.optim.lr_scheduler.LRScheduler, obj)
            if id(getattr(sched, "optimizer", None)) in in_use:
                out.append(
                    f"LR scheduler {kind.__name__} of {_optim_name(sched.optimizer, names)} "
                    "is not tracked: after a restore it starts again from its first step; "
                    "track it, e.g. ctx.track(..., sched=scheduler)"
                )
        elif what == "scaler":
            scaler = cast(torch.amp.GradScaler, obj)
            if scaler.is_enabled() and getattr(scaler, "_scale", None) is not None:
                out.append(
                    "a GradScaler in use is not tracked: its loss scale and growth count start "
                    "again after a restore; track it, e.g. ctx.track(..., scaler=scaler)"
                )
        elif stateful(obj):
            out.append(
                f"a {kind.__name__}{_loader_detail(obj)} has a state_dict() but is not tracked "
                "(nor held by a tracked object): after a restore it starts its data epoch "
                "again; track it, e.g. ctx.track(..., data=loader)"
            )
    out += _positions(loop_iterators or [], ids)
    out += notes(tracked, iterators)
    out += _param_findings(tracked, ran, unseen_ddps)
    if not scaling:
        optims = [*tracked.values(), *(o for _, o in holds.values())]
        out += _accumulating(
            [o for o in optims if isinstance(o, torch.optim.Optimizer)],
            {id(o) for o in stepped},
            names,
        )
    return out


def _accumulating(
    optims: list[torch.optim.Optimizer], stepped: set[int], names: dict[int, str]
) -> list[str]:
    """Tracked optimizers that did not step in the step, though its backward left gradients
    in their parameters: the loop accumulates gradients across ``ctx.steps`` steps (one
    micro-batch a step), which no snapshot saves."""
    out = []
    for optim in optims:
        if id(optim) in stepped:
            continue
        grads = [p.grad for g in optim.param_groups for p in g["params"] if p.grad is not None]
        if any(bool(local_of(grad).any()) for grad in grads):
            out.append(
                f"{_optim_name(optim, names)} did not step in the first step, but its backward "
                "left gradients in its parameters: gradients accumulated across ctx.steps "
                "steps are not in a snapshot, so after a restore the accumulation starts again "
                "from zero; make one ctx.steps step one optimizer step (run the micro-batches "
                "inside it)"
            )
    return out


def _positions(iterators: list[tuple[str, Any]], ids: set[int]) -> list[str]:
    """The loop's variables holding an iterator of a plain torch DataLoader that gave batches
    in the step: the loader keeps no position, so after a restore the iterator the code
    before the loop makes starts the data epoch again (unless its indices come from a
    tracked sampler, which keeps its own: then only worker processes, which take indices
    ahead, are named). An iterator wrapped by the script (an
    ``itertools.islice`` that skips the batches already taken, as Hugging Face's Trainer
    resumes) is not the variable's value, and is not judged."""
    out = []
    for name, it in iterators:
        batches = getattr(it, "_index_sampler", None)
        if getattr(it, "_num_yielded", 0) <= 0:
            continue
        dataset = type(getattr(it, "_dataset", None)).__name__
        if id(batches) in ids or id(getattr(batches, "sampler", None)) in ids:
            workers = getattr(it, "_num_workers", 0)
            if workers:  # they take indices ahead of the step: the snapshot's are ahead too
                out.append(
                    f"`{name}` iterates a torch DataLoader over a {dataset} whose sampler is "
                    f"tracked, with {workers} worker process{'es' if workers > 1 else ''}: "
                    "they take indices batches ahead of the step, so the sampler a snapshot "
                    "holds is ahead of the step and a restore skips those batches; iterate it "
                    "with num_workers=0, or use torchdata's StatefulDataLoader tracked as "
                    "data (ctx.track(..., data=loader)), which counts what was delivered"
                )
            continue
        out.append(
            f"`{name}` iterates a torch DataLoader over a {dataset}, which keeps no position: "
            "after a restore the iterator the code before the loop makes starts the data epoch "
            "again, and the steps after it train on other batches (unless that code skips the "
            "batches the committed step had taken); use torchdata's StatefulDataLoader tracked "
            "as data (ctx.track(..., data=loader)), or draw indices with a tracked "
            "peerckpt.ResumableSampler"
        )
    return out


def _classify(kind: type) -> str:
    if issubclass(kind, torch.optim.lr_scheduler.LRScheduler):
        return "scheduler"
    if issubclass(kind, torch.amp.GradScaler):
        return "scaler"
    if issubclass(kind, (DataLoader, Sampler)):
        return "loader"
    if issubclass(kind, _MultiProcessingDataLoaderIter):
        return "workers"
    return ""


def _ddp_finding(module: DistributedDataParallel) -> str:
    return (
        f"a DistributedDataParallel over a {type(module.module).__name__} runs, but neither it "
        "nor the module it wraps is tracked: its gradient buckets cannot be restored, so the "
        "steps after a restore sum gradients in another order; track the module it wraps "
        "whole (ctx.track(model=ddp.module)) or the DDP itself"
    )


def _param_findings(
    tracked: dict[str, Any],
    ran: list[torch.nn.Module],
    unseen_ddps: list[DistributedDataParallel],
) -> list[str]:
    """Trainable parameters of modules that ran but belong to no tracked object."""
    storages = covered_storages(tracked, buffers=False)
    reported = {id(m) for d in unseen_ddps for m in d.module.modules()}  # said above
    loose = []
    for module in ran:
        if id(module) in reported:
            continue
        params = [p for p in module._parameters.values() if p is not None and p.requires_grad]
        if any(local_of(p).untyped_storage().data_ptr() not in storages for p in params):
            loose.append(module)
    if not loose:
        return []
    shown = ", ".join(_module_name(m) for m in loose[:3])
    more = f" and {len(loose) - 3} more" if len(loose) > 3 else ""
    return [
        f"trainable parameters of {shown}{more} (modules that ran in the step) belong to no "
        "tracked object: they are built again, not restored, after a failure; track the model "
        "they belong to, e.g. ctx.track(model=model)"
    ]


def covered_storages(tracked: dict[str, Any], buffers: bool = True) -> set[int]:
    """Storage addresses of every tensor a tracked object holds: modules' parameters (and
    ``buffers``), tensors, shards; also of the modules and tensors a tracked Stateful holds."""
    out: set[int] = set()
    for obj in [*tracked.values(), *(obj for _, obj in held(tracked).values())]:
        tensors: list[torch.Tensor] = []
        if isinstance(obj, torch.nn.Module):
            tensors = [*obj.parameters(), *(obj.buffers() if buffers else ())]
        elif isinstance(obj, (torch.Tensor, Shard)):
            tensors = [local_of(obj)]
        elif isinstance(obj, FlatShard):
            tensors = [obj.local]
        for t in tensors:
            out.add(local_of(t).untyped_storage().data_ptr())
    return out


Versions = dict[int, tuple[torch.nn.Module, list[tuple[torch.Tensor, int]]]]


def module_versions(
    tracked: dict[str, Any], heap: Iterable[object]
) -> tuple[Versions, list[torch.nn.Module]]:
    """For each module of ``heap`` with tensors of its own (parameters, buffers) that no
    tracked object holds: those tensors and their versions (in-place writes count up); and
    every module of ``heap`` (what may hold them)."""
    covered = covered_storages(tracked)
    out: Versions = {}
    modules: list[torch.nn.Module] = []
    kinds: dict[type, bool] = {}  # never isinstance: some objects warn when it is asked
    for obj in heap:
        kind = type(obj)
        wanted = kinds.get(kind)
        if wanted is None:
            wanted = kinds[kind] = issubclass(kind, torch.nn.Module) and not issubclass(
                kind, DistributedDataParallel
            )
        if not wanted:
            continue
        obj = cast(torch.nn.Module, obj)
        modules.append(obj)
        own = [
            t
            for t in [*obj._parameters.values(), *obj._buffers.values()]
            if isinstance(t, torch.Tensor)
            and local_of(t).untyped_storage().data_ptr() not in covered
        ]
        if own:
            out[id(obj)] = (obj, [(t, t._version) for t in own])
    return out, modules


def changed_modules(
    versions: Versions,
    ran: set[int],
    modules: list[torch.nn.Module],
) -> list[str]:
    """Modules whose untracked tensors were written in the step (an EMA copy updated in
    place, the running statistics of a model that is not tracked), less those that ran with
    trainable parameters (``_param_findings`` names them)."""

    def trainable(module: torch.nn.Module) -> bool:
        return any(p is not None and p.requires_grad for p in module._parameters.values())

    changed = {
        key
        for key, (module, tensors) in versions.items()
        if not (key in ran and trainable(module)) and any(t._version != v for t, v in tensors)
    }
    if not changed:
        return []
    # Named by the outermost modules that hold them (the EMA copy, not its every layer).
    holders = {id(m): m for m in modules if any(id(sub) in changed for sub in m.modules())}
    inner = {id(sub) for m in holders.values() for sub in m.modules() if sub is not m}
    roots = [m for key, m in holders.items() if key not in inner]
    shown = ", ".join(_holder_name(m) for m in roots[:3])
    more = f" and {len(roots) - 3} more" if len(roots) > 3 else ""
    one = len(roots) == 1
    return [
        f"{shown}{more} {'was' if one else 'were'} written in the step but "
        f"{'is' if one else 'are'} not tracked (an EMA or averaged copy of the model?): after "
        f"a restore {'it is' if one else 'they are'} what the code before the loop made, not "
        "what the step left; track it, e.g. ctx.track(..., ema=ema_model)"
    ]


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _holder_name(module: torch.nn.Module) -> str:
    tensors = [*module.parameters(), *module.buffers()]
    return (
        f"{_a(type(module).__name__)} ({len(tensors)} tensor(s), "
        f"{sum(t.numel() for t in tensors):,} values)"
    )


def _optim_name(optim: torch.optim.Optimizer, names: dict[int, str]) -> str:
    params = [p for g in optim.param_groups for p in g["params"]]
    known = [names[id(p)] for p in params if id(p) in names]
    what = f" ({', '.join(known[:3])}{', …' if len(known) > 3 else ''})" if known else ""
    return f"optimizer {type(optim).__name__} over {len(params)} parameter(s){what}"


def _module_name(module: torch.nn.Module) -> str:
    shapes = ", ".join(
        f"{k} {'×'.join(map(str, p.shape))}" for k, p in module._parameters.items() if p is not None
    )
    return f"a {type(module).__name__} ({shapes})"


def _loader_detail(obj: object) -> str:
    dataset = getattr(obj, "dataset", None)
    return f" over a {type(dataset).__name__}" if dataset is not None else ""
