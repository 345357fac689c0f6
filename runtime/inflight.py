"""The collectives in flight that an abort must end; DDP's gradient all-reduce and buffer
broadcast among them.

Why this exists (measured on torch 2.13, gloo's TCP transport). A gloo send is written to its
connection from a queue once the peer has posted the matching receive; when the peer stops
reading (it was killed, or it is a survivor whose own abort cut the connection) the rest of
the send waits in that queue. When the connection then closes, gloo fails every receive and
every send still waiting for the peer's receive, but not a send already in that queue:
``Pair::signalException`` signals the queued operations' bound buffers (``op.buf``) only,
while a collective's sends use unbound buffers (``op.ubuf``). Its ``waitSend`` then waits out
the whole process-group timeout (1800 s here). Reproduced in two processes (a 64 MiB
``isend`` to a peer that posted its ``irecv`` and stopped: the send's ``wait`` raised after the
full 20 s timeout when the connection was cut, after 0.5 s when the peer had not posted it).
In a 2 x 2 DDP job with a node killed under load, this was the survivor "still inside aborted
epoch" in ``loss.backward()``: one of gloo's worker threads in ``UnboundBuffer::waitSend`` of
the ring all-reduce, and the training thread in ``Reducer::finalize_backward`` waiting for that
bucket's future (2 runs of 10, 1 of 12; stacks taken with gdb). Cutting sockets cannot end that
wait, and ``ProcessGroup.abort()`` is a no-op for gloo.

So the training thread must not wait on gloo's own future. ``release_on_abort`` routes a
CPU DDP's gradient all-reduce through a communication hook that does what DDP's built-in
all-reduce does, bit for bit (the bucket scaled by ``1 / world size``, then summed), and
returns a future that ``InFlight`` owns: it completes when gloo's does, or fails at once
when the epoch is aborted (``InFlight.release``), so ``backward`` raises and the function
unwinds. The gloo worker stays inside ``waitSend`` until its timeout; the group it belongs to
must not be freed before then, since freeing a gloo group joins its workers
(``runtime/pg.py`` keeps it).

Any collective's send can be left so, not only the all-reduce's. In a 2 x 2 DCGAN-like job
with a node killed (1 run in 7), a survivor stayed 40 s, until the watchdog restarted it, in
DDP's buffer broadcast at the start of a forward (``broadcast_buffers=True`` with BatchNorm:
``_sync_buffers`` → ``_distributed_broadcast_coalesced`` → ``dist._broadcast_coalesced``,
C++ waiting on gloo's work); reproduced in ``tests/runtime/ddp_gloo.py`` (``broadcast-plain``
ends at the group's timeout). So ``release_on_abort`` also gives a CPU DDP its own
``_distributed_broadcast_coalesced``: the same buckets, flattened and broadcast as torch's,
waited on through ``InFlight``. A broadcast copies: no bit changes.

Not covered (the abort watchdog's restart in place remains their way out): the gradient
all-reduce of a DDP with a communication hook of its own or with ``gradient_as_bucket_view=True``
(DDP divides aliased gradients differently there; a hook would change the bits), a DDP on a
GPU, a DDP the runtime never sees run a forward in an epoch's first step, DDP's broadcasts at
construction and its ``_find_common_rank`` (``Join``), a buffer communication hook, and the
script's collectives called with ``async_op=True`` (its blocking ones go through ``InFlight``
too: ``runtime/usercoll.py``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import functools
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from peerckpt.errors import MembershipChanged

log = logging.getLogger("peerckpt.rank")


@dataclass
class _Watched:
    work: torch.futures.Future[Any]  # gloo's future: it may never complete after a cut
    outcome: torch.futures.Future[Any]  # (value, error): set once, by the work or the abort


def _unwrap(outcome: torch.futures.Future[Any]) -> Any:
    # Raised inside ``then``, an error reaches a C++ waiter (DDP's reducer) as an error;
    # ``Future.set_exception`` would hand it the exception object as the value instead.
    value, error = outcome.value()
    if error is not None:
        raise error
    return value


def outcome_of(outcome: torch.futures.Future[Any]) -> Any:
    """Wait for an outcome from ``InFlight.watch``: its value, or its error raised."""
    outcome.wait()
    return _unwrap(outcome)


class InFlight:
    """The collectives of this process whose waiters an abort must release.

    ``issue`` starts a collective and watches it (any thread); ``release`` is the abort's (any
    thread, any number of times); ``reopen`` starts the next epoch. Each watched future
    completes exactly once: with the collective, or at ``release``, whichever comes first.
    Once released, ``issue`` starts nothing: the epoch is over, and a collective posted on a
    connection the abort has just cut may be one that gloo never ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, _Watched] = {}
        # A weak reference to each collective's callback → its work, until the thread that
        # ran the callback has let go of it (``quiesce``): the reference's own callback is
        # this dict's ``pop``, C code run as the callback is freed, with no bytecode after it.
        self._callbacks: dict[weakref.ref[Any], torch.futures.Future[Any]] = {}
        self._keys = itertools.count()
        self._released: str | None = None  # why, once this epoch's collectives were released

    def issue(
        self, start: Callable[[], torch.futures.Future[Any]], pick: Callable[[Any], Any]
    ) -> torch.futures.Future[Any]:
        """Start a collective (``start()`` returns its future) and return a future that
        completes with ``pick(its value)``, with its error, or with ``MembershipChanged`` at
        ``release``; failed at once, nothing started, after ``release``. For a waiter in C++
        (DDP's reducer): its error reaches Python as a ``RuntimeError`` naming it."""
        return self.watch(start, pick).then(_unwrap)

    def watch(
        self, start: Callable[[], torch.futures.Future[Any]], pick: Callable[[Any], Any]
    ) -> torch.futures.Future[Any]:
        """``issue`` for a waiter in Python: the future of the outcome, ``(value, error)``;
        ``outcome_of`` returns the value or raises the error as itself."""
        key = next(self._keys)
        outcome: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:  # a release waits for a collective being started: it then sees it
            if self._released is not None:
                outcome.set_result((None, MembershipChanged(self._released)))
                return outcome
            work = start()
            self._open[key] = _Watched(work, outcome)
            done = functools.partial(self._done, key, pick)
            self._callbacks[weakref.ref(done, self._callbacks.pop)] = work
        work.add_done_callback(done)
        del done  # from now on only the work holds it, and then the thread that runs it
        return outcome

    def _done(self, key: int, pick: Callable[[Any], Any], finished: Any) -> None:
        """A watched collective's callback, run by the thread that completed it (one of
        gloo's): settles its outcome. Frames of this method never keep the callback (a
        ``partial``) alive, so an error's traceback does not hold up ``quiesce``."""
        with contextlib.suppress(Exception):  # never in the way of settling the outcome
            _keep_thread_state()
        try:
            value = pick(finished.value())
        except Exception as exc:
            self._settle(key, error=exc)
        else:
            self._settle(key, value=value)

    def _settle(self, key: int, value: Any = None, error: Exception | None = None) -> None:
        with self._lock:
            entry = self._open.pop(key, None)
        if entry is not None:  # else released already
            entry.outcome.set_result((value, error))

    def release(
        self,
        why: str,
        unfinished: Callable[[list[torch.futures.Future[Any]]], None] = lambda works: None,
    ) -> int:
        """Fail every watched future still open with ``MembershipChanged(why)``, and any
        collective issued from now on, until ``reopen``; return how many were open.

        ``unfinished`` is first told which of them have not finished (gloo may hold them
        until its timeout): before any waiter wakes, since a waiter's next move is to leave
        the epoch, which must know them."""
        with self._lock:
            self._released = why
            entries = list(self._open.values())
            self._open.clear()
        unfinished([e.work for e in entries if not e.work.done()])
        for entry in entries:
            entry.outcome.set_result((None, MembershipChanged(why)))
        return len(entries)

    def reopen(self) -> None:
        """A new epoch: collectives may be issued again."""
        with self._lock:
            self._released = None

    def open(self) -> int:
        """How many watched collectives are in flight."""
        with self._lock:
            return len(self._open)

    def waiting(self) -> bool:
        """Whether a watched collective is in flight, without the lock (read by the
        heartbeat thread, which must not wait for a collective being started)."""
        return bool(self._open)

    def quiesce(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until no finished collective's callback is still held
        by the thread that ran it; True if none is. A collective stuck in gloo (see the
        module's docstring) is not waited for: its callback may never run.

        Why (``terminate called without an active exception``, a rank killed by SIGABRT as
        its script exited, about 1 run in 90 under load): the callback runs in one of
        gloo's threads, which takes the GIL for it, releases it while ``Future.set_result``
        wakes DDP's waiter, takes it back, and, once the callback has returned, takes it once
        more to let go of it (torch's guard of a Python callback drops its reference with the
        GIL held). The training thread, woken, may run on to the interpreter's exit between
        any two of those; a thread that takes the GIL once the interpreter finalizes is ended
        by ``pthread_exit``, whose unwinding through a C++ destructor (``noexcept``)
        terminates the process. So what is waited for is the callback's release, seen by a
        weak reference whose callback runs as C code inside it (``watch``). Waited for at
        exit (``atexit``, while the interpreter is whole); the waiting sleeps, giving the
        GIL to those threads."""
        deadline = time.monotonic() + timeout_s
        while any(work.done() for work in list(self._callbacks.values())):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True


_kept = threading.local()  # ``on`` once this thread's Python thread state is kept


def _keep_thread_state() -> None:
    """Keep, for the rest of its life, the Python thread state of the thread running this
    (one of gloo's, running a collective's callback).

    Why (a rank hung, and the job with it, inside ``os.fork()`` of a DataLoader worker: 1 run
    in 15 to 20 of pytorch/examples' imagenet/main.py adapted, without a fault too). torch
    runs a Python callback on a thread of its own through pybind11, which makes a Python
    thread state for the call and deletes it afterwards, when no other holds it: three per
    watched collective (the callback, letting go of it, the value's last reference), each
    made under the interpreter's thread-state lock without the GIL. A fork at that moment
    copies the lock held, and CPython 3.11 takes it in the child before resetting it
    (``PyOS_AfterFork_Child`` → ``_PyEval_ReInitThreads`` → ``_PyThreadState_DeleteExcept``):
    the child waits forever, never reaching a fork handler. gdb on a hung worker: the newest
    thread state in its copy of the interpreter's list belonged to the rank's
    ``pt_gloo_runloop`` thread. A count held here (``PyGILState_Ensure``, never released)
    makes pybind11 find that state again each time instead of making one: none is made
    after a thread's first callback (``tests/runtime/test_inflight.py``; in a fork stress,
    8 hung forks in 2000 before, none after). Done only where the thread's registered state
    is the one running this, so the count cannot go to another thread's state."""
    if getattr(_kept, "on", False):
        return
    if _registered_state() == _current_state():
        _gil_ensure()  # the state is current: only its count goes up
        _kept.on = True


# Prototypes of their own (the GIL kept across the call), not ``ctypes.pythonapi``'s shared ones.
_registered_state = ctypes.PYFUNCTYPE(ctypes.c_void_p)(
    ("PyGILState_GetThisThreadState", ctypes.pythonapi)
)
_current_state = ctypes.PYFUNCTYPE(ctypes.c_void_p)(("PyThreadState_Get", ctypes.pythonapi))
_gil_ensure = ctypes.PYFUNCTYPE(ctypes.c_int)(("PyGILState_Ensure", ctypes.pythonapi))


IN_FLIGHT = InFlight()  # this process's, like torch.distributed's default group
QUIESCE_AT_EXIT_S = 5.0


def _quiesce_at_exit() -> None:
    if not IN_FLIGHT.quiesce(QUIESCE_AT_EXIT_S):
        log.warning(
            "a collective's callback was still running %.0f s into the interpreter's exit",
            QUIESCE_AT_EXIT_S,
        )


atexit.register(_quiesce_at_exit)


@dataclass(frozen=True)
class _HookState:
    group: dist.ProcessGroup
    in_flight: InFlight


def _allreduce(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's built-in all-reduce (``at::mul_out(bucket, grad, 1 / world)`` as the gradients
    are copied in, then a sum), waited on through ``InFlight``."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / state.group.size())

    def start() -> torch.futures.Future[Any]:
        work = dist.all_reduce(buffer, group=state.group, async_op=True)
        assert work is not None
        return work.get_future()

    return state.in_flight.issue(start, lambda value: value[0])


# DDP checks a hook's annotations against the classes themselves; this module's are strings.
_allreduce.__annotations__ = {
    "state": _HookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _broadcast_coalesced(
    module: DistributedDataParallel,
    in_flight: InFlight,
    tensors: list[torch.Tensor],
    buffer_size: int,
    authoritative_rank: int = 0,
) -> None:
    """``dist._broadcast_coalesced`` as DDP calls it for its buffers, waited on through
    ``in_flight``: the same buckets (``compute_bucket_assignment_by_size``), each flattened and
    broadcast from the group rank ``authoritative_rank``, at most two in flight, then copied
    back into its tensors. The wire sees what it sees from torch's own; a broadcast copies,
    so no bit changes."""
    group = module.process_group
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [buffer_size])
    pending: collections.deque[tuple[list[torch.Tensor], torch.Tensor, Any]] = collections.deque()

    def finish() -> None:
        bucket, flat, outcome = pending.popleft()
        outcome_of(outcome)
        for tensor, received in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            tensor.copy_(received)

    for indices in buckets:
        if len(pending) == 2:
            finish()
        bucket = [tensors[i] for i in indices]
        flat = _flatten_dense_tensors(bucket)

        def start(flat: torch.Tensor = flat) -> torch.futures.Future[Any]:
            work = dist.broadcast(flat, group=group, group_src=authoritative_rank, async_op=True)
            assert work is not None
            return work.get_future()

        pending.append((bucket, flat, in_flight.watch(start, lambda value: None)))
    while pending:
        finish()


def release_on_abort(module: DistributedDataParallel, in_flight: InFlight = IN_FLIGHT) -> bool:
    """Route ``module``'s buffer broadcast (once per DDP object, on CPU) and its gradient
    all-reduce through ``in_flight``; False where the all-reduce is left as it is, since
    routing it would change what DDP computes or cannot apply (see the module's docstring)."""
    if module.device_type == "cpu" and "_distributed_broadcast_coalesced" not in vars(module):
        module._distributed_broadcast_coalesced = functools.partial(  # type: ignore[method-assign]
            _broadcast_coalesced, module, in_flight
        )
    if getattr(module, "_peerckpt_in_flight", None) is in_flight:
        return True
    why = _unsupported(module)
    if why:
        log.debug("a survivor blocked in this DDP's all-reduce is not released at once: %s", why)
        return False
    module.register_comm_hook(_HookState(module.process_group, in_flight), _allreduce)
    module._peerckpt_in_flight = in_flight  # type: ignore[assignment]
    return True


def _unsupported(module: DistributedDataParallel) -> str:
    if module._comm_hooks or module._get_ddp_logging_data().get("comm_hook"):
        return "it has a communication hook of its own"
    if getattr(module, "_use_python_reducer", False):
        return "it reduces in Python (compiled autograd)"
    if module.device_type != "cpu":
        return f"its parameters are on {module.device_type}"
    if module.gradient_as_bucket_view:
        return "gradient_as_bucket_view=True"
    return ""
