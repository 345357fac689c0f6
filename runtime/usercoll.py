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
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

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


ORIGINALS: dict[str, Callable[..., Any]] = {name: getattr(dist, name) for name in NAMES}
REPLACED: dict[str, Callable[..., Any]] = {
    name: released_on_abort(original) for name, original in ORIGINALS.items()
}
