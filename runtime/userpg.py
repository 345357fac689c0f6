"""A training script's own ``dist.init_process_group``, ``destroy_process_group``,
``get_rank`` and ``get_world_size`` under peerckpt: harmless, said once in the log, refused
only where they contradict the job.

Every torchrun script calls ``init_process_group`` (and, at its end,
``destroy_process_group``). Under peerckpt the runtime forms each epoch's default group
itself (``runtime/pg.py``), and the script's call raised torch's "trying to initialize the
default process group twice!" with no hint. Once installed (``install``, when ``@resilient``
decorates, and already at ``import peerckpt`` in a job's training process), their names in
``torch.distributed`` are this module's functions, and so is every name a
module of the script bound to torch's own functions before (``from torch.distributed import
init_process_group`` at the top of a file, as the PyTorch DDP tutorial does):

- ``init_process_group(...)`` inside an epoch does nothing and returns: the group it asks for
  is the one peerckpt formed. A backend, a world size or a rank that contradicts that group
  is a ``ConfigurationError`` naming the fix. Outside an epoch (before the decorated function
  runs) it does nothing either: peerckpt forms the group when the function starts.
- ``destroy_process_group()`` of the default group does nothing (peerckpt destroys it when
  the epoch ends); of another group, torch's own.
- ``get_rank()`` and ``get_world_size()`` before any group exists (the script's top level,
  right after its own ``init_process_group``) answer ``RANK`` and ``WORLD_SIZE``, which
  peerckpt sets for the rank the process runs as; otherwise torch's own.

After the job's training succeeded, the last epoch's group is left to the script's code after
the decorated function (a barrier, its evaluation's collectives), as under torchrun
(``runtime/rank.py``), and its ``destroy_process_group()`` is torch's own.

Its blocking collectives (``dist.all_reduce`` …) are put where the script finds them the same
way, so that an epoch's abort releases a rank waiting in one (``runtime/usercoll.py``).

The runtime calls torch's own functions (``ORIGINAL_INIT``, ``ORIGINAL_DESTROY``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from peerckpt.errors import ConfigurationError
from peerckpt.runtime import usercoll

log = logging.getLogger("peerckpt.rank")

ORIGINAL_INIT: Callable[..., Any] = c10d.init_process_group
ORIGINAL_DESTROY: Callable[..., Any] = c10d.destroy_process_group
ORIGINAL_GET_RANK: Callable[..., int] = c10d.get_rank
ORIGINAL_GET_WORLD_SIZE: Callable[..., int] = c10d.get_world_size
_said: set[str] = set()
_lock = threading.Lock()
_backend: Callable[[], str] = lambda: "gloo"  # noqa: E731 (set by ``install``)
_handed_over = False  # the job's training ended: the last group is the script's (``hand_over``)


def _once(key: str, text: str) -> None:
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.info("%s", text)


def _compatible(asked: str, formed: str) -> bool:
    """Whether a script asking for backend ``asked`` runs on a group formed with ``formed``."""
    asked, formed = asked.lower(), formed.lower()
    if asked == formed:
        return True
    parts = {p.partition(":")[2] or p for p in formed.split(",")}
    if ":" not in asked:
        return asked in parts and (asked == "nccl" or "cuda:nccl" not in formed)
    return set(asked.split(",")) <= set(formed.split(","))


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: Any = None,
    world_size: int = -1,
    rank: int = -1,
    *args: Any,
    **kwargs: Any,
) -> None:
    """The script's call: see the module docstring."""
    if not dist.is_initialized():
        _once(
            "early",
            "dist.init_process_group() in the script: peerckpt forms each epoch's process "
            "group when the decorated function starts; this call does nothing",
        )
        return
    formed = _backend()
    epoch_rank, epoch_world = dist.get_rank(), dist.get_world_size()
    if backend is not None and not _compatible(str(backend), formed):
        raise ConfigurationError(
            f"the script calls dist.init_process_group(backend={backend!r}), but peerckpt "
            f"forms this job's groups with {formed!r}: pass @peerckpt.resilient("
            f"backend={str(backend)!r}), or drop the backend from the call"
        )
    if world_size not in (-1, None) and world_size != epoch_world:
        raise ConfigurationError(
            f"the script calls dist.init_process_group(world_size={world_size}), but this epoch "
            f"has {epoch_world} rank(s) (a recovery may change it): drop world_size and rank "
            "from the call, or read them from the environment (peerckpt sets WORLD_SIZE and "
            "RANK for every epoch) or from ctx.world_size / ctx.rank"
        )
    if rank not in (-1, None) and rank != epoch_rank:
        raise ConfigurationError(
            f"the script calls dist.init_process_group(rank={rank}), but this process is rank "
            f"{epoch_rank} in this epoch: drop rank from the call, or read it from RANK or "
            "ctx.rank"
        )
    _once(
        "init",
        f"dist.init_process_group() in the script: peerckpt already formed this epoch's group "
        f"({formed}, rank {epoch_rank} of {epoch_world}); the call does nothing",
    )


def hand_over() -> None:
    """The job's training succeeded: the last epoch's group is the script's from now on (its
    code after the decorated function), and so is destroying it."""
    global _handed_over
    _handed_over = True


def destroy_process_group(group: Any = None) -> None:
    """The script's call: see the module docstring."""
    if _handed_over:
        ORIGINAL_DESTROY(group)
        return
    if group is None or group is c10d.GroupMember.WORLD:
        _once(
            "destroy",
            "dist.destroy_process_group() in the script: peerckpt destroys each epoch's group "
            "when the epoch ends; the call does nothing",
        )
        return
    ORIGINAL_DESTROY(group)


def _from_environment(name: str, call: str) -> int | None:
    """Before any group exists, in a training process of a job: ``name`` from the
    environment (peerckpt sets it for the rank the process runs as), said once."""
    value = os.environ.get(name)
    if dist.is_initialized() or not os.environ.get("PEERCKPT_JOB") or value is None:
        return None
    _once(
        "env:" + name,
        f"dist.{call}() before the decorated function runs: peerckpt forms the process group "
        f"when it starts; the answer is {name} from the environment ({value})",
    )
    return int(value)


def get_rank(group: Any = None) -> int:
    """torch's, and before any group exists (at the script's top level, after its own
    ``init_process_group``, as Lightning Fabric and Accelerate call it) ``RANK``."""
    found = _from_environment("RANK", "get_rank") if group is None else None
    return found if found is not None else ORIGINAL_GET_RANK(group)


def get_world_size(group: Any = None) -> int:
    """torch's, and before any group exists ``WORLD_SIZE`` (as ``get_rank``)."""
    found = _from_environment("WORLD_SIZE", "get_world_size") if group is None else None
    return found if found is not None else ORIGINAL_GET_WORLD_SIZE(group)


_REPLACED = (  # torch's function, and the one put where a script finds it
    (ORIGINAL_INIT, init_process_group),
    (ORIGINAL_DESTROY, destroy_process_group),
    (ORIGINAL_GET_RANK, get_rank),
    (ORIGINAL_GET_WORLD_SIZE, get_world_size),
    *((usercoll.ORIGINALS[name], ours) for name, ours in usercoll.REPLACED.items()),
)
_scanned: set[str] = set()  # modules whose names were rebound (each is looked at once)


def install(backend: Callable[[], str]) -> None:
    """Put these functions where the script finds torch's: ``torch.distributed``'s names, and
    every name a module outside torch and peerckpt bound to torch's own functions (modules
    loaded since the last call: the runtime calls it when the function is first entered and
    at every epoch, so that a module the function imported is covered from the next one).
    ``backend``: the backend peerckpt forms groups with."""
    global _backend
    _backend = backend
    _rebind(remember=True)


def install_early() -> None:
    """At ``import peerckpt`` in a training process of a job (``peerckpt/__init__.py``):
    a script that calls ``init_process_group`` at its top level, before the decorated
    function runs (nanoGPT's ``train.py``), finds these functions already. Modules are not
    remembered as looked at: the script's own module is only partly run here, and the
    names it binds later are rebound when the function is entered."""
    _rebind(remember=False)


def rescan() -> None:
    """Look at every module again at the next ``install``: a process that installed these
    while the script's own module was still running (``runtime/standby.py``)."""
    _scanned.clear()


def _rebind(remember: bool) -> None:
    dist.init_process_group = init_process_group
    dist.destroy_process_group = destroy_process_group
    dist.get_rank = get_rank
    dist.get_world_size = get_world_size
    for name, collective in usercoll.REPLACED.items():  # released by an abort (usercoll.py)
        setattr(dist, name, collective)
    for name, module in list(sys.modules.items()):
        if name in _scanned or module is None or name.split(".")[0] in ("torch", "peerckpt"):
            continue
        if remember:
            _scanned.add(name)
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            # by identity: a module's values need not be hashable (nor comparable)
            for original, ours in _REPLACED:
                if value is original:
                    namespace[key] = ours
