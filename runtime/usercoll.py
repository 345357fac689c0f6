"""The script's own collectives (``dist.all_reduce`` and the like, called and waited for in
its code), released by an epoch's abort.

PyTorch's "Writing Distributed Applications" tutorial averages gradients itself, one
``dist.all_reduce`` per parameter, without DDP; so do many research scripts. A survivor of a
node kill could be left inside such a call with a send gloo never ends (``inflight.py`` has
why): measured on the tutorial's network with a 9.4 MB layer, rank 0 stayed in its
``all_reduce`` until the abort watchdog restarted it in place, 40.1 s after the kill (the
rest of the recovery took 0.3 s).

So, in a training process of a job, ``torch.distributed``'s blocking collectives are these
functions (installed with the script's ``init_process_group`` by ``runtime/userpg.py``, also
where a module of the script bound torch's own). Each starts torch's own with
``async_op=True`` and waits on ``InFlight``'s outcome of it, which the abort fails at once: the
call raises ``MembershipChanged`` and the function unwinds. The collective itself is torch's,
on the same tensors: no bit changes. Left as they are: a call with ``async_op=True`` (the
script waits on torch's ``Work``), a call on a GPU tensor (NCCL's abort ends those), a barrier
on a group with NCCL, a call while ``torch.compile`` traces, and ``send``/``recv``,
``monitored_barrier`` and the object collectives (torch runs them inside the call).

Before the decorated function runs there is no group (peerckpt forms it when the function
starts; the script's own ``init_process_group`` did nothing). A collective there — torchvision's
``init_distributed_mode`` calls ``dist.barrier()`` right after ``init_process_group``, and
"rank 0 prepares the data, the others wait at a barrier" is a common top level — got torch's
"Default process group has not been initialized, please make sure to call
init_process_group", which contradicts the script. It is refused instead (``early``), naming
why and where it belongs: a spare or a restarted process runs the script's top level alone,
when it takes a rank, so a collective there could never have a partner.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from peerckpt.errors import ConfigurationError
from peerckpt.runtime.inflight import IN_FLIGHT, outcome_of

NAMES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)


# Run as torch's, but refused like the others before any group exists.
EARLY_ONLY = (
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "monitored_barrier",
)


def early(name: str) -> None:
    """Refuse ``dist.<name>()`` called before any group exists in a job's training process
    (the script's top level, before the decorated function runs)."""
    if dist.is_initialized() or not os.environ.get("PEERCKPT_JOB"):
        return
    raise ConfigurationError(
        f"dist.{name}() before the decorated function runs: there is no process group yet. "
        "peerckpt forms it when the function starts (the script's init_process_group does "
        "nothing), because a spare or a restarted process runs the script's top level alone "
        f"when it takes a rank, where a collective could never have a partner. Move the "
        f"{name}() into the decorated function, before ctx.track, where every rank of each "
        "epoch runs it (a barrier after rank 0 prepares the data belongs there too, the "
        "preparation skipped when its files exist); a barrier right after "
        "init_process_group, as torchvision's init_distributed_mode has, can go"
    )


def _tensors(values: Iterator[Any]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _releasable(arguments: dict[str, Any]) -> bool:
    """Whether a call with these arguments runs on gloo over CPU tensors, blocking."""
    if arguments.get("async_op") or torch.compiler.is_compiling():
        return False
    tensors = list(_tensors(iter(arguments.values())))
    if tensors:
        return all(t.device.type == "cpu" for t in tensors)
    try:  # a barrier: no tensor says which backend runs it
        return "nccl" not in str(dist.get_backend(arguments.get("group"))).lower()
    except (RuntimeError, ValueError):
        return False  # no group: torch's own says so


def released_on_abort(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a blocking collective of torch's), waited on through ``InFlight``."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        early(original.__name__)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # torch's own names the mistake
        if not _releasable(bound.arguments):
            return original(*args, **kwargs)
        bound.arguments["async_op"] = True

        def start() -> torch.futures.Future[Any]:
            work = original(*bound.args, **bound.kwargs)
            if work is None:  # this rank is not in the group: nothing runs
                done: torch.futures.Future[Any] = torch.futures.Future()
                done.set_result(None)
                return done
            future: torch.futures.Future[Any] = work.get_future()
            return future

        outcome_of(IN_FLIGHT.watch(start, lambda value: None))
        return None

    collective.__peerckpt_original__ = original  # type: ignore[attr-defined]
    return collective


def refused_early(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` itself, refused before any group exists (``early``)."""

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        early(original.__name__)
        return original(*args, **kwargs)

    collective.__peerckpt_original__ = original  # type: ignore[attr-defined]
    return collective


ORIGINALS: dict[str, Callable[..., Any]] = {
    name: getattr(dist, name) for name in (*NAMES, *EARLY_ONLY)
}
REPLACED: dict[str, Callable[..., Any]] = {
    name: released_on_abort(original) if name in NAMES else refused_early(original)
    for name, original in ORIGINALS.items()
}
