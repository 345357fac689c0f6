"""Which tracked objects cannot follow a change of world size, found when they are tracked.

After a shrink or a grow, per-rank data state is restored through ``load_resharded_state``
when the object has it (``peerckpt.Reshardable``); any other object gets one old rank's state
through ``load_state_dict`` (``runtime/restore.py``). That is right for state every rank
holds alike (an LR scheduler, a GradScaler) and wrong for a data loader's position: rank r's
place in *its* share of the data means nothing in a world of another size. Measured with
torchdata's ``StatefulDataLoader`` over a ``DistributedSampler``: after a shrink the ranks
silently trained on another data order (samples lost and repeated), and after a grow the
new world's loaders raised ``StopIteration`` mid-job, their loaded position past the end of
their smaller shares.

Resharding such a loader exactly-once would mean rewriting its private state (its
sampler's iterator position, its workers' fetcher states, DistributedSampler's padding) for
another share of another permutation; the runtime refuses the change up front instead. This
module names the objects: a tracked object without ``load_resharded_state`` that is, or
holds a few attributes deep, a torch ``DataLoader`` or ``Sampler``. Rank 0 reports them at
``ctx.track`` (``runtime/tracking.py``); the coordinator then refuses to start the job
elastic (``--min-nodes``) and refuses nodes that join; and a rank that is asked to reshard
one all the same refuses with ``StateMismatch`` rather than load another rank's position.

A user object that keeps a position without a torch loader inside cannot be told from
replicated state; docs/resharding.md says what it gets. Pure: no I/O, no logging.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from peerckpt.errors import NotReshardable
from peerckpt.runtime.layouts import FlatShard, Shard

_DEPTH = 3  # attributes followed from a tracked object to a loader it holds
_WIDE = 1000  # containers larger than this are a data set's rows, not where a loader is kept


def unreshardable(tracked: dict[str, Any]) -> list[str]:
    """One line per tracked object whose state cannot follow a change of world size: its
    name and what it is, e.g. ``data (a StatefulDataLoader with a DistributedSampler)``."""
    out = []
    for name, obj in tracked.items():
        if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
            continue
        if isinstance(obj, (Shard, FlatShard)) or hasattr(obj, "load_resharded_state"):
            continue
        loader = _loader_in(obj)
        if loader is not None:
            out.append(f"{name} ({_describe(obj, loader)})")
    return out


def refusal(objects: list[str]) -> str:
    """Why a change of world size is refused, with the fix (the coordinator's and the
    rank's messages end with it)."""
    return (
        f"the job tracks data-loader state that cannot be resharded: {'; '.join(objects)}. "
        "After a shrink or a grow every rank would take another rank's position in a share "
        f"of another size, losing and repeating samples; {NotReshardable.FIX}"
    )


def _loader_in(obj: object) -> object | None:
    """``obj`` itself if it is a DataLoader or Sampler, else the first one it holds."""
    seen: set[int] = set()
    frontier = [obj]
    for _ in range(_DEPTH + 1):
        following: list[object] = []
        for item in frontier:
            if id(item) in seen or isinstance(item, (torch.Tensor, torch.nn.Module)):
                continue
            seen.add(id(item))
            if isinstance(item, (DataLoader, Sampler)):
                return item
            if isinstance(item, (dict, list, tuple, set, frozenset)) and len(item) > _WIDE:
                continue
            if isinstance(item, dict):
                following.extend(item.values())
            elif isinstance(item, (list, tuple, set, frozenset)):
                following.extend(item)
            elif hasattr(item, "__dict__") and not isinstance(item, type):
                following.extend(vars(item).values())
        frontier = following
    return None


def _describe(obj: object, loader: object) -> str:
    what = f"a {type(obj).__name__}"
    if loader is not obj:
        what += f" holding a {type(loader).__name__}"
    sampler = getattr(loader, "sampler", None)
    if isinstance(loader, DataLoader) and isinstance(sampler, Sampler):
        what += f" with a {type(sampler).__name__}"
    return what
