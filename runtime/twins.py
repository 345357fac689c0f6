"""Which chunks of a rank's snapshot are data-parallel replicas: the rank's declaration.

With DDP over the whole world, every rank holds bit-identical parameters and optimizer state
(DDP all-reduces the gradients and every rank runs the same optimizer step), so rank 0 on
node 0 and rank 2 on node 1 already keep the same bytes in two failure domains. The rank
*declares* those chunks (their indices in the snapshot's layout, ``manifest.extra["twins"]``);
its agent then mirrors only the rest to the buddies (``replication/dedup.py``), and the
coordinator *verifies* at every commit that the declared chunks of all twins have equal
checksums before it counts them as held by the twins' nodes (``recovery/twins.py``).

Declared: the parameters of every tracked module that a DDP over the default (whole-world)
group wraps, and the state of every tracked optimizer whose parameters all belong to such
modules. Not declared: buffers (BatchNorm statistics are updated after DDP's broadcast, per
rank), RNG, data-loader state, anything else. A declaration that turns out wrong costs a
second, full push (the coordinator's verification), never a lost byte.

This module reads the tracked objects; it never changes them and does no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from peerckpt.runtime.capture import param_fqns


def _whole_world(ddp: DistributedDataParallel) -> bool:
    """Whether ``ddp`` reduces over every rank of the job (its group is the world's size)."""
    if not dist.is_initialized():
        return False
    group = getattr(ddp, "process_group", None)
    try:
        return bool(dist.get_world_size(group) == dist.get_world_size())
    except (RuntimeError, ValueError):
        return False


def declared_keys(tracked: dict[str, Any], ddps: Iterable[tuple[str, Any]]) -> frozenset[str]:
    """The chunk keys of ``tracked``'s snapshot that every data-parallel rank holds equal.

    ``ddps``: (tracked name, DDP object) for every DDP met this epoch that wraps (or is) a
    tracked object (``runtime/ddp.py``'s ``DdpLayouts.found``).
    """
    modules: dict[str, torch.nn.Module] = {}
    for name, ddp in ddps:
        if isinstance(ddp, DistributedDataParallel) and _whole_world(ddp):
            obj = tracked.get(name)
            if isinstance(obj, torch.nn.Module):
                modules[name] = obj
    if not modules:
        return frozenset()
    keys: set[str] = set()
    replicated: set[int] = set()  # id() of every parameter a world DDP keeps equal
    for name, module in modules.items():
        # A module's state_dict names its parameters as named_parameters() does, and the
        # snapshot walks the tracked object's state_dict (``runtime/capture.py``).
        for fqn, param in module.named_parameters():
            keys.add(f"{name}/{fqn}")
            replicated.add(id(param))
    fqns = param_fqns(tracked)  # how the optimizer's state is keyed in the snapshot
    for name, obj in tracked.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        params = [p for group in obj.param_groups for p in group["params"]]
        if not params or any(id(p) not in replicated for p in params):
            continue  # some of its state is not data-parallel: none of it is declared
        for param in params:
            for field, value in obj.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    keys.add(f"{name}/state/{fqns[id(param)]}/{field}")
    return frozenset(keys)


def twin_indices(chunks: Iterable[Any], keys: frozenset[str]) -> list[int]:
    """Indices of the layout's chunks (``ChunkRecord``s) whose key was declared, shared-scope
    ones only (a rank's private state is never a twin)."""
    return [i for i, c in enumerate(chunks) if c.scope == "global" and c.key in keys]
