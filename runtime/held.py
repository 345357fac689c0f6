"""What the tracked Stateful objects hold: the model and optimizer inside DCP's ``AppState``.

torch.distributed.checkpoint's tutorials wrap the model and the optimizer in one ``Stateful``
whose ``state_dict()`` calls ``get_state_dict(model, optimizer)``; torchtitan keeps its models,
optimizers and schedulers in containers of that kind. Tracked as one object
(``ctx.track(app=AppState(model, optim))``), those are saved and restored through it, so what
it holds is tracked: the audit does not name them (``runtime/audit.py``), and a
DistributedDataParallel over a model it holds keeps its bucket layout (``runtime/ddp.py``).
An object a tracked Stateful holds is taken to be what its ``state_dict()`` saves.
"""

from __future__ import annotations

from typing import Any

import torch

_WIDE = 1000  # containers larger than this are a data set's rows, not where state is kept
_LEAVES = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)


def held(tracked: dict[str, Any], depth: int = 4) -> dict[int, tuple[str, object]]:
    """Every object the tracked Stateful objects hold, ``depth`` attributes, items or elements
    deep, by id: (a dotted path from the tracked name, the object). Modules, optimizers and
    tensors are listed, not searched further."""
    seen: dict[int, tuple[str, object]] = {}
    frontier = [(name, obj) for name, obj in tracked.items() if not isinstance(obj, _LEAVES)]
    for _ in range(depth + 1):
        following: list[tuple[str, object]] = []
        for path, obj in frontier:
            if id(obj) in seen:
                continue
            seen[id(obj)] = (path, obj)
            if isinstance(obj, _LEAVES):
                continue
            if isinstance(obj, (dict, list, tuple, set, frozenset)) and len(obj) > _WIDE:
                continue
            if isinstance(obj, dict):
                following.extend((f"{path}.{k}", v) for k, v in obj.items())
            elif isinstance(obj, (list, tuple)):
                following.extend((f"{path}.{i}", v) for i, v in enumerate(obj))
            elif isinstance(obj, (set, frozenset)):
                following.extend((path, v) for v in obj)
            elif hasattr(obj, "__dict__"):
                following.extend((f"{path}.{k}", v) for k, v in vars(obj).items())
        frontier = following
    return seen
