"""Keep DistributedDataParallel bit-exact across an in-process restart.

DDP reduces gradients in flat buckets. Its first iteration uses one bucket in parameter
registration order; from the second on it uses buckets rebuilt in the order gradients became
ready. gloo's ring all-reduce sums an element in an order that depends on its position in
the bucket, so the first iteration after a restore (a new DDP object) would sum in a
different order than the fault-free run did at that step, and the bits would drift.

The runtime therefore records the rebuilt bucket layout in every snapshot and, when it
restores into a DDP module that has not rebuilt its buckets yet, re-creates the module's
reducer with exactly that layout, through DDP's own ``_ddp_init_helper``. Measured: with
this, a 4-rank DDP transformer restored mid-run matches the fault-free run bit for bit; without
it, the first resumed step differs. These are private DDP APIs of torch 2.13; the chaos tests
compare bits and fail loudly if a torch upgrade changes them.

The DDP object need not be tracked. Users track the module and wrap it afterwards
(``ctx.track(model=net); ddp = DDP(net)``), or wrap first and track ``ddp.module``: the
runtime then meets the DDP at its first forward of the epoch (``runtime/audit.py`` watches
that step) and ``DdpLayouts`` keys its layout by the name of the tracked module it wraps,
applying a restored layout right there, before that forward runs. Measured (the inner-tracked
case of ``tests/test_user_loops.py``): without this, every step after a restore differed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from peerckpt.runtime.held import held

log = logging.getLogger("peerckpt.ddp")


def bucket_layout(module: DistributedDataParallel) -> list[list[int]] | None:
    """The rebuilt bucket layout (parameter indices per bucket), once DDP has rebuilt it."""
    data = module._get_ddp_logging_data()
    if not data.get("has_rebuilt_buckets"):
        return None
    text = data.get("rebuilt_per_bucket_param_indices", "")
    if not isinstance(text, str) or not text.strip():
        return None
    return [[int(i) for i in part.split()] for part in text.split(",") if part.strip()]


def apply_bucket_layout(module: DistributedDataParallel, buckets: list[list[int]]) -> bool:
    """Re-create ``module``'s reducer with ``buckets``; False if it does not apply."""
    if getattr(module, "_has_rebuilt_buckets", False):
        return False
    params, sparse = module._build_params_for_reducer()
    if sorted(i for b in buckets for i in b) != list(range(len(params))):
        log.warning("recorded DDP bucket layout does not fit this module; left as built")
        return False
    sizes = [sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets]
    mapping = module._build_debug_param_to_name_mapping(params)
    module.reducer._remove_autograd_hooks()
    original = dist._compute_bucket_assignment_by_size

    def recorded(*args: Any, **kwargs: Any) -> tuple[list[list[int]], list[int]]:
        # DDP reverses what this returns (it assumes registration order); undo that.
        return list(reversed(buckets)), list(reversed(sizes))

    dist._compute_bucket_assignment_by_size = recorded
    try:
        module._ddp_init_helper(params, sparse, mapping, module.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = original
    if module.static_graph:  # DDP tells its reducer in __init__ only, after this helper
        module._static_graph_delay_allreduce_enqueued = False
        module.reducer._set_static_graph()
        if module.logger is not None:
            module.logger._set_static_graph()
    return True


def settle_buckets(module: DistributedDataParallel) -> None:
    """Rebuild ``module``'s buckets now where its next forward would (DDP's own
    ``_pre_forward`` step: after its first iteration, once)."""
    if getattr(module, "_has_rebuilt_buckets", False) or not torch.is_grad_enabled():
        return
    if module.reducer._rebuild_buckets():
        module._has_rebuilt_buckets = True
        if module.logger is not None:  # what ``bucket_layout`` reads is updated here
            module.logger.set_runtime_stats_and_log()


class DdpLayouts:
    """The DDP bucket layouts of one epoch: captured from, and restored into, every DDP that
    wraps a tracked module or is tracked itself (or held by a tracked Stateful), keyed by that
    tracked object's name.

    ``restore`` takes the layouts of the restored snapshot and applies them to the DDPs
    tracked so far; ``see`` is called for every DDP that runs a forward in the epoch's first
    step and applies a pending layout to it before that forward runs. A layout applied here
    is also what ``layouts`` reports until the DDP rebuilds its buckets again, so that the
    snapshot of the first step after a restore still carries it.
    """

    def __init__(self, tracked: dict[str, Any]) -> None:
        self.tracked = tracked
        self._pending: dict[str, list[list[int]]] = {}
        self._applied: dict[str, list[list[int]]] = {}
        self._found: dict[str, DistributedDataParallel] = {}

    def name_of(self, module: DistributedDataParallel) -> str | None:
        """The tracked name of ``module`` or of the module it wraps, or its path in a tracked
        Stateful that holds either (``app.model``: ``runtime/held.py``); None if none is."""
        for name, obj in self.tracked.items():
            if obj is module or obj is module.module:
                return name
        for path, obj in held(self.tracked).values():
            if obj is module or obj is module.module:
                return path
        return None

    def restore(self, layouts: dict[str, list[list[int]]]) -> None:
        self._pending.update(layouts)
        for obj in list(self.tracked.values()):
            if isinstance(obj, DistributedDataParallel):
                self.see(obj)

    def see(self, module: DistributedDataParallel) -> str | None:
        """Remember ``module`` (a DDP met in the first step); apply its restored layout."""
        name = self.name_of(module)
        if name is None:
            return None
        self._found[name] = module
        layout = self._pending.pop(name, None)
        if layout is not None and apply_bucket_layout(module, layout):
            self._applied[name] = layout
        return name

    def found(self) -> list[tuple[str, DistributedDataParallel]]:
        """(tracked name, DDP) of every DDP known this epoch: met in its first step, or
        tracked itself."""
        found = dict(self._found)
        for name, obj in self.tracked.items():
            if isinstance(obj, DistributedDataParallel):
                found.setdefault(name, obj)
        return list(found.items())

    def layouts(self) -> dict[str, list[list[int]]]:
        """The layout of every known DDP, for the snapshot of this step. A DDP that ran an
        iteration but has not rebuilt its buckets yet (it would at its next forward) rebuilds
        them now, so that the snapshot carries the layout the next step uses: restored from
        this snapshot into a new DDP, that step then reduces in the same buckets. (Without
        it, a restore from the snapshot of step 0 ran step 1 in the initial buckets and its
        bits differed.) Every rank snapshots the same steps, so the broadcast of the layout
        that rebuilding does pairs up as it would have in the forward."""
        found = dict(self._found)
        for name, obj in self.tracked.items():
            if isinstance(obj, DistributedDataParallel):
                found.setdefault(name, obj)
        out = {}
        for name, module in found.items():
            settle_buckets(module)
            layout = bucket_layout(module) or self._applied.get(name)
            if layout is not None:
                out[name] = layout
        return out
