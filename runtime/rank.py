"""The rank runtime: one per training process, driving the decorated function through epochs.

State machine (``RankState``; every change goes through ``_become``)::

    SPARE ──assigned──▶ JOINING ◀──epoch── WAITING
                          │ process group up
                          ▼
    ABORTING ◀──notice── RUNNING ──function returned──▶ FINISHED ──shutdown──▶ EXITED
       │                   ▲  │                            │
       └──next epoch──▶ JOINING  └──error──▶ FAILED        └──notice──▶ ABORTING

An *abort notice* (a new epoch from the coordinator, relayed by the agent) cuts this rank's
process-group connections at once, so a collective blocked on a dead peer raises within
milliseconds. The function's frame unwinds, the group is destroyed, and the function is
called again in the same process for the new epoch; ``ctx.track`` restores the committed
step from the rank's own slot (or from what the agent pulled from a peer).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from peerckpt import faults as fault_hooks
from peerckpt.errors import (
    CheckpointError,
    ConfigurationError,
    MembershipChanged,
    PeerckptError,
    StateMismatch,
)
from peerckpt.manifest import ChunkRecord
from peerckpt.messages import Dispatch, Message
from peerckpt.messages.control import Commit, Shutdown
from peerckpt.messages.local import (
    STACK_SIGNAL,
    Abort,
    AgentLost,
    Arrived,
    Beat,
    EpochStart,
    Fenced,
    Granted,
    ProcHello,
    ProcSettings,
    RankDone,
    RankError,
    Restarting,
    Staging,
)
from peerckpt.runtime import capture, userpg, waits
from peerckpt.runtime.abort import AbortWatchdog, exit_code, exit_if_still_inside
from peerckpt.runtime.channel import AgentChannel
from peerckpt.runtime.config import DEFAULTS, ResilientConfig
from peerckpt.runtime.env import LaunchEnv, RankFilter
from peerckpt.runtime.live import LiveState
from peerckpt.runtime.pg import ProcessGroupLifecycle, nccl_environment
from peerckpt.runtime.snapshot import SnapshotEngine
from peerckpt.runtime.state import Assignment, RankState, check_transition
from peerckpt.runtime.tracking import AuditOnce, EpochTracking
from peerckpt.states import EpochMode, ExitCode, JobState, ProcRole

log = logging.getLogger("peerckpt.rank")
# What a spare imports while it waits (``_warm_up``), and what a launcher's prefork server
# imports once for every spare it forks (``launch/prefork.py``).
WARM_MODULES = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.algorithms")
_READY_S = 30.0  # the constructor's work after the link is up: milliseconds


class JobEnded(Exception):
    """The job ended while this process waited."""


class RankRuntime:
    """Runs a resilient function in this process, epoch after epoch."""

    def __init__(
        self,
        env: LaunchEnv,
        config: ResilientConfig = DEFAULTS,
    ) -> None:
        if not faulthandler.is_enabled():
            # A crash in native code (SIGSEGV, SIGABRT…) prints every thread's Python stack
            # before the process dies: the launcher names the signal, this says where.
            faulthandler.enable(all_threads=True)
        self._unwound = -1  # the last epoch whose function this process has left
        self._in_function = False  # the script's function runs (in its current epoch)
        self.env = env
        self.state = RankState.WAITING if env.role is ProcRole.RANK else RankState.SPARE
        self._cond = threading.Condition()
        self._latest_epoch = -1
        self._assignments: dict[int, Assignment] = {}
        self._shutdown: Shutdown | None = None
        self.assignment: Assignment | None = None
        self.tracking: EpochTracking | None = None  # the joined epoch's restore and snapshots
        self._audit = AuditOnce()
        self._staging: dict[tuple[int, int], tuple[str, list[ChunkRecord]]] = {}
        self._arrived: dict[int, Arrived] = {}  # epoch → where its arriving state now is
        self._initial_rng = capture.capture_rng()
        self.live = LiveState()  # what the live tensors hold: a survivor restores from them
        self._settings(config)  # a bad setting fails here, before this process says hello
        RankFilter.runtime = self
        if self.state is RankState.SPARE:
            self._warm_up()  # before saying hello: a spare is chosen only once it is ready
        self._events = Dispatch[None](
            {
                Abort: lambda e: self._abort(e.epoch),
                EpochStart: self._on_epoch,
                Commit: lambda e: self.engine.on_commit(e.epoch, e.step),
                Staging: self._on_staging,
                Arrived: self._on_arrived,
                Shutdown: self._on_shutdown,
                Fenced: self._on_fenced,
                AgentLost: self._on_agent_lost,
            },
            f"rank process {os.getpid()}",
        )
        # The link's reader thread may deliver an event (the job's end, to a spare that
        # joined just then) before the rest of this constructor has run: it waits for it.
        self._ready = threading.Event()
        hello = ProcHello(
            env.role,
            os.getpid(),
            env.rank,
            config.replicas,
            config.persist_msg(),
            config.erasure,
            stacks=_stacks_on_signal(),  # before the first heartbeat: asked from then on
        )
        self.channel = AgentChannel(
            env.agent_socket, env.secret, env.job, hello, self._on_event, self._beat
        )
        nccl_environment(os.environ)  # before any NCCL group: peerckpt aborts them itself
        self.faults = fault_hooks.load(env.node)
        self.engine = SnapshotEngine(
            self.channel, node=env.node, faults=self.faults, dedup=config.dedup
        )
        self._stop = threading.Event()
        self._watchdog = threading.Thread(
            target=self._watch_parent, name="peerckpt-watchdog", daemon=True
        )
        self._watchdog.start()
        self._ready.set()

    # -- events from the agent (reader thread) ---------------------------------------------
    def _on_event(self, event: Message) -> None:
        self._ready.wait(_READY_S)
        self._events.handle(event)

    def _on_epoch(self, event: EpochStart) -> None:
        with self._cond:
            self._assignments[event.epoch] = Assignment.from_event(event)
            self._latest_epoch = max(self._latest_epoch, event.epoch)
            self._cond.notify_all()

    def _on_staging(self, event: Staging) -> None:
        with self._cond:
            self._staging[(event.epoch, event.round)] = (event.path, list(event.manifest.chunks))
            self._cond.notify_all()

    def _on_arrived(self, event: Arrived) -> None:
        with self._cond:
            self._arrived[event.epoch] = event
            self._cond.notify_all()

    def _on_shutdown(self, event: Shutdown) -> None:
        self.channel.expect_close()
        with self._cond:
            already_told = self._shutdown is not None  # the coordinator may say it again
            self._shutdown = event
            self._cond.notify_all()
        self.engine.abort()
        if self.state in (RankState.RUNNING, RankState.JOINING):
            self.pg.abort()
        if event.state is not JobState.SUCCEEDED and not already_told:
            exit_if_still_inside(
                self._stop,
                self.config.abort_grace_s,
                f"the job ended ({event.state.value}) during epoch {self._latest_epoch}",
            )

    def _on_fenced(self, event: Fenced) -> None:
        # Declared lost while this process was stopped or frozen, and replaced. Whatever it
        # was doing, it must not act in the job again: no snapshot, no collective, no write.
        # Nothing of the job is owned here (the agent owns the memory), so leaving at once
        # is clean.
        log.error("%s; this process exits without touching the job", event.reason)
        self.channel.expect_close()
        logging.shutdown()
        os._exit(ExitCode.OK)

    def _on_agent_lost(self, event: AgentLost) -> None:
        with self._cond:
            if self._shutdown is not None:
                return
        log.error("the node agent is gone (node lost); this rank process exits")
        os._exit(ExitCode.NODE_LOST)

    def _abort(self, epoch: int) -> None:
        with self._cond:
            self._latest_epoch = max(self._latest_epoch, epoch)
            current = self.assignment.epoch if self.assignment else -1
            if epoch <= current or self.state not in (
                RankState.JOINING,
                RankState.RUNNING,
                RankState.FINISHED,
            ):
                self._cond.notify_all()
                return
            self._become(RankState.ABORTING)
            self._cond.notify_all()
        self.engine.abort()
        self.pg.abort()
        AbortWatchdog(
            self._cond,
            lambda: self._unwound >= current,
            lambda: self.pg.abort(everything=True),
            lambda waited_s: self._give_up(current, waited_s),
            self.config.abort_grace_s,
            self.config.abort_timeout_s,
        ).start(current)

    def _give_up(self, epoch: int, waited_s: float) -> None:
        """Leave for good a process that cannot leave aborted epoch ``epoch``
        (``runtime/abort.py``): a fresh process on this node takes its place, or none."""
        why = (
            f"could not leave aborted epoch {epoch} within {waited_s:.0f} s (blocked in a "
            "collective that cutting its connections did not release)"
        )

        def announce() -> bool:
            try:
                self.channel.request(Restarting(why), Granted, timeout=5.0)
                return True
            except Exception as exc:  # the agent is gone or did not answer: just leave
                log.warning("could not announce a restart in place: %s", _short(exc))
                return False

        code = exit_code(int(os.environ.get("PEERCKPT_RESTARTS", "0")), announce)
        if code is ExitCode.RESTART:
            log.error("%s; a fresh process on this node takes its place", why)
        else:
            log.error("%s; this process exits and the job goes on without it", why)
        logging.shutdown()
        os._exit(code)

    def _restart_on_comm_error(self, exc: BaseException) -> None:
        """Under torchrun, a collective that failed without an abort notice (a peer died)
        ends this process: torchrun restarts every worker, which then restore from their
        host's memory. Waiting here for a verdict would only hold torchrun's restart back."""
        if not self.env.restart_based or not _looks_like_comm_error(exc):
            return
        with self._cond:
            if self.state is not RankState.RUNNING or self._shutdown is not None:
                return
        log.warning(
            "%s; exiting for %s to restart this worker", _short(exc), self.env.restart_based
        )
        logging.shutdown()
        os._exit(ExitCode.RESTART)

    def _become(self, state: RankState) -> None:
        check_transition(self.state, state)
        log.debug("state %s → %s", self.state.name, state.name)
        self.state = state

    def _watch_parent(self) -> None:
        parent = os.getppid()
        while not self._stop.wait(0.5):
            if os.getppid() != parent:
                log.error("the launcher is gone; this rank process exits")
                os._exit(ExitCode.LAUNCHER_GONE)

    # -- the epoch loop ---------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from peerckpt.runtime.api import Context

        result = None
        try:
            while True:
                if self.assignment is not None:
                    _free_last_epoch()
                try:
                    assignment = self._next_assignment()
                except JobEnded:
                    break
                try:
                    self._join(assignment)
                    assert self.tracking is not None
                    self._in_function = True  # its loop's step is live (heartbeats carry it)
                    try:
                        result = fn(Context(self.tracking), *args, **kwargs)
                    finally:
                        self._in_function = False
                    self._finish()
                except BaseException as exc:
                    self._restart_on_comm_error(exc)
                    if self._superseded(exc):
                        log.warning(
                            "epoch %d ended by a membership change (%s)",
                            assignment.epoch,
                            _short(exc),
                        )
                        self._leave()
                        continue
                    if self._shutdown is not None and isinstance(exc, Exception):
                        log.error("the job was stopped: %s", self._shutdown.reason or "-")
                        raise SystemExit(1) from None
                    self._fail(exc)
                    raise
                if self._await_end():
                    break
                self._leave()
        finally:
            self.close()
        if self.assignment is None:
            raise SystemExit(0)  # a spare that was never needed: nothing of the script runs
        return result

    def _warm_up(self) -> None:
        """A spare pays, while it waits, the one-time costs a replacement would otherwise add
        to the recovery: DDP's first construction imports torch._dynamo (1.7 s measured here),
        and the first backward pass starts autograd's worker."""
        import importlib

        started = time.perf_counter()
        for module in WARM_MODULES:
            try:
                importlib.import_module(module)
            except ImportError:
                pass
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward()
        log.info("spare warmed up in %.2f s", time.perf_counter() - started)

    def configure(self, config: ResilientConfig) -> None:
        """Take the decorator's settings in a process that waited for its rank with the
        defaults (``runtime/standby.py``), before the function is run: the snapshot policy,
        the process groups' timeout and backend, dedup; and, as a process created at the
        function's call, the random states the script's top level left (``_initial_rng``)."""
        with self._cond:
            assert self.state is RankState.SPARE, self.state
            self.engine.dedup = config.dedup
            self._initial_rng = capture.capture_rng()
            userpg.rescan()  # the script's module ran on since the runtime was created
            self._settings(config)
        # Its hello said the defaults: a restarted coordinator reads the job's settings from
        # the agents' reports of their processes (recovery/rebuild.py).
        self.channel.notify(ProcSettings(config.replicas, config.persist_msg(), config.erasure))

    def _settings(self, config: ResilientConfig) -> None:
        """What the decorator's settings make: the snapshot policy (``runtime/policy.py``), the
        process groups' timeout and backend, and the script's own init/destroy_process_group
        bound to them (``runtime/userpg.py``)."""
        self.config = config
        self.policy = config.snapshot_policy(self.env.snapshot_every)
        self.pg = ProcessGroupLifecycle(self.env.job, config.pg_timeout_s, config.backend)
        userpg.install(self.pg.backend)

    def await_assignment(self) -> Assignment:
        """Wait for this spare's first assignment and return it, left for ``run`` to take
        (a later epoch's, if one came meanwhile, is the one ``run`` joins). JobEnded if
        the job ended first."""
        with self._cond:
            while True:
                if self._shutdown is not None:
                    raise JobEnded()
                if self._latest_epoch in self._assignments:
                    return self._assignments[self._latest_epoch]
                self._cond.wait()

    def _next_assignment(self) -> Assignment:
        with self._cond:
            while True:
                if self._shutdown is not None:
                    raise JobEnded()
                current = self.assignment.epoch if self.assignment else -1
                if self._latest_epoch > current and self._latest_epoch in self._assignments:
                    return self._assignments.pop(self._latest_epoch)
                self._cond.wait()

    def _join(self, assignment: Assignment) -> None:
        with self._cond:
            if self._latest_epoch > assignment.epoch:
                raise MembershipChanged(f"epoch {assignment.epoch} ended before it was joined")
            self._become(RankState.JOINING)
            self.assignment = assignment
            self.tracking = EpochTracking(
                assignment,
                self.channel,
                self.engine,
                self.pg,
                self.check,
                self._wait_staging,
                self._wait_arrived,
                self._audit,
                self.live,
                self.policy,
                started_job=self.env.role is ProcRole.RANK,
                faults=self.faults,
            )
            # Under the lock: an abort notice is either seen above or cuts what this opens.
            self.pg.begin(assignment.epoch, assignment.store_addr, set(assignment.hosts))
        os.environ.update(
            RANK=str(assignment.rank),
            WORLD_SIZE=str(assignment.world_size),
            LOCAL_RANK=str(assignment.local_rank),
        )
        userpg.install(self.pg.backend)  # modules the function imported meanwhile too
        self.engine.begin_epoch(
            assignment.epoch,
            assignment.rank,
            assignment.restore_slot,
            assignment.restore_step,
            assignment.restore_path,
        )
        same = assignment.mode is EpochMode.SAME
        self.live.keep_for(
            assignment.rank, assignment.world_size, assignment.restore_step if same else None
        )
        # Re-entry is a fresh start: the function begins with the RNG states this process
        # had when it first entered it, whatever the last epoch drew since (setup code that
        # draws — a synthetic dataset, random_split, an init before ctx.track — then draws
        # as it did the first time: 28 of 40 steps of the DDP tutorial's trainer, seeded
        # once at program start, differed without it). ``ctx.steps`` then applies the
        # restored step's own states.
        capture.restore_rng(self._initial_rng)
        log.info(
            "joining epoch %d as rank %d of %d (restore step %s)",
            assignment.epoch,
            assignment.rank,
            assignment.world_size,
            assignment.restore_step,
        )
        self.pg.join(assignment.store_addr, assignment.rank, assignment.world_size)
        with self._cond:
            if self.state is RankState.JOINING and self._latest_epoch <= assignment.epoch:
                self._become(RankState.RUNNING)
                return
        raise MembershipChanged(f"epoch {assignment.epoch} ended while its group formed")

    def _superseded(self, exc: BaseException) -> bool:
        """Was ``exc`` caused by a membership change (now or within the suspect window)?"""
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return False
        deadline = time.monotonic() + (
            self.config.suspect_s if _looks_like_comm_error(exc) else 0.0
        )
        with self._cond:
            while True:
                current = self.assignment.epoch if self.assignment else -1
                if self._latest_epoch > current or self.state is RankState.ABORTING:
                    return True
                if self._shutdown is not None:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    def _leave(self) -> None:
        with self._cond:
            if self.assignment is not None:
                self._unwound = max(self._unwound, self.assignment.epoch)
                self._cond.notify_all()
        if self.tracking is not None:
            self.tracking.close()
        self.pg.leave()
        with self._cond:
            if self.state is not RankState.ABORTING:
                self._become(RankState.ABORTING)

    def _finish(self) -> None:
        assert self.assignment is not None
        self.engine.wait_copy()
        last = self.engine.last_taken
        if last is not None and not self.engine.wait_committed(last, self.engine.commit_timeout_s):
            log.warning("the last snapshot (step %d) was never committed", last)
        with self._cond:
            if self.state is not RankState.RUNNING:
                raise MembershipChanged("membership changed as the function returned")
            self._become(RankState.FINISHED)
        self.channel.notify(RankDone(self.assignment.epoch, self.assignment.rank))

    def _await_end(self) -> bool:
        """After the function returned: True when the job ended, False for a new epoch."""
        with self._cond:
            while True:
                if self._shutdown is not None:
                    return True
                if self.state is RankState.ABORTING:
                    return False
                self._cond.wait()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.state not in (RankState.FAILED, RankState.EXITED):
                self._become(RankState.FAILED)
        if self.assignment is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            try:
                self.channel.notify(
                    RankError(
                        self.assignment.epoch,
                        self.assignment.rank,
                        type(exc).__name__,
                        str(exc)[:2000],
                    )
                )
            except PeerckptError:
                pass

    def close(self) -> None:
        self._stop.set()
        if self.tracking is not None:
            self.tracking.close()
        self.engine.close()
        self.faults.close()
        if self._succeeded():
            # The script's code after the function (a barrier, its evaluation's collectives)
            # runs on the last epoch's group, as under torchrun; it is destroyed at exit.
            userpg.hand_over()
            atexit.register(_destroy_at_exit)
        else:
            self.pg.leave()
        with self._cond:
            if self.state is not RankState.EXITED:
                self.state = RankState.EXITED
        self.channel.close()
        self._watchdog.join(timeout=1.0)

    def _succeeded(self) -> bool:
        """The job ended well and this process was a rank in its last epoch."""
        with self._cond:
            ended = self._shutdown
        return (
            ended is not None
            and ended.state is JobState.SUCCEEDED
            and self.assignment is not None
            and self.state not in (RankState.FAILED, RankState.ABORTING)
        )

    def _beat(self) -> Beat:
        """A heartbeat, with the live step when the loop runs one."""
        tracking = self.tracking
        if (
            tracking is None
            or tracking.step is None
            or not self._in_function
            or self.state is not RankState.RUNNING
        ):
            return Beat()  # not in its loop: an epoch that ended has no live step
        in_flight = sys.modules.get("peerckpt.runtime.inflight")  # no collective without it
        waiting = waits.now() or (in_flight is not None and in_flight.IN_FLIGHT.waiting())
        return Beat(tracking.assignment.rank, tracking.step, tracking.total, waiting)

    # -- what Context and the epoch's tracking call -----------------------------------------
    @property
    def step(self) -> int | None:
        """The step the loop is in (for log records), None outside ``ctx.steps``."""
        return self.tracking.step if self.tracking is not None else None

    def _wait_staging(self, epoch: int, round_: int) -> tuple[str, list[ChunkRecord]]:
        """The staging segment the agent gathered for ``round_`` of ``epoch``: its path and
        chunks; MembershipChanged if the epoch ends first."""
        with self._cond:
            while (epoch, round_) not in self._staging:
                if self.state is RankState.ABORTING or self._shutdown is not None:
                    raise MembershipChanged("the job's membership changed during a restore")
                self._cond.wait()
            return self._staging.pop((epoch, round_))

    def _wait_arrived(self, epoch: int) -> Arrived:
        """Where the agent put ``epoch``'s arriving state (``RestorePlan.arriving``), once it
        is verified there; MembershipChanged if the epoch ends first."""
        with self._cond:
            while epoch not in self._arrived:
                if self.state is RankState.ABORTING or self._shutdown is not None:
                    raise MembershipChanged("the job's membership changed during a restore")
                self._cond.wait()
            for older in [e for e in self._arrived if e < epoch]:  # superseded epochs'
                del self._arrived[older]
            return self._arrived.pop(epoch)

    def check(self) -> None:
        """Raise MembershipChanged if this epoch has ended (called at step boundaries)."""
        with self._cond:
            if self.state is RankState.ABORTING or self._shutdown is not None:
                raise MembershipChanged("the job's membership changed")


# Words of a failed collective's error (gloo's "Connection reset by peer", NCCL's, a
# DistBackendError, a timeout), as words: "peer" inside "peerckpt" named in one of this
# package's own refusals made a ZeroRedundancyOptimizer refused at ctx.track wait out the
# suspect window (30 s) before the job failed.
_COMM_WORDS = re.compile(r"\b(gloo|connection|timed out|distbackenderror|nccl|peers?|socket)\b")


def _free_last_epoch() -> None:
    """Free the last epoch's objects before the function runs again, where they hold a GPU.

    What the function built (its model, optimizer, DDP and process group) is unreachable once
    it has unwound, but much of it sits in reference cycles (a module's hooks, the frames an
    exception's traceback held), which only Python's full collection frees, at a moment of its
    choosing. On a GPU the next epoch's model and optimizer state would be allocated beside
    the last one's, and a job that fills its GPU would run out of memory on its first
    recovery. A full collection here costs tens to hundreds of milliseconds (200–360 ms
    measured on this project's 2-core machine under load); on CPU the garbage waits for the
    collector's own next full pass, and DataLoader workers forked meanwhile never collect it
    (``runtime/children.py``).
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    started = time.perf_counter()
    found = gc.collect()
    log.debug(
        "freed the last epoch's objects (%d unreachable) in %.0f ms",
        found,
        (time.perf_counter() - started) * 1e3,
    )


def _looks_like_comm_error(exc: BaseException) -> bool:
    """Could ``exc`` come from a collective whose peer died (worth waiting up to the suspect
    window for the abort notice)? peerckpt's own refusals never do, whatever they say."""
    if isinstance(exc, MembershipChanged):
        return True
    if isinstance(exc, (ConfigurationError, StateMismatch, CheckpointError)):
        return False
    return _COMM_WORDS.search(f"{type(exc).__name__} {exc}".lower()) is not None


_CALLBACK = "Got the following error when running the callback: "  # torch's Future.then


def _short(exc: BaseException) -> str:
    """One line for the log: the error's first line, without the trace torch appends to an
    error that crossed C++ ("At: …/inflight.py(64): _unwrap" from a future's callback,
    "Exception raised from … (most recent call first)" from c10) or its callback wrappers;
    the whole text is logged at debug level."""
    text = f"{type(exc).__name__}: {exc}"
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    inner = first
    while inner.startswith(_CALLBACK):  # the error raised in the callback names its type
        inner = inner[len(_CALLBACK) :]
    line = inner if inner != first else f"{type(exc).__name__}: {first}".rstrip(": ")
    if line != text.rstrip(": "):  # a trace or a wrapper was left out
        log.debug("%s, in full: %s", line, text)
    return line if len(line) < 160 else line[:157] + "..."


def _stacks_on_signal() -> bool:
    """Write every thread's Python stack to stderr on ``STACK_SIGNAL``: the agent sends it
    when this rank's step stops moving (``replication/stall.py``), only to a process that
    said it could (the signal's default action ends the process). faulthandler's C handler
    writes it while the training thread is stuck, even inside a C call holding the GIL."""
    try:
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
    except (ValueError, OSError, AttributeError, RuntimeError) as exc:
        log.debug("no stacks on signal %d: %r", STACK_SIGNAL, exc)
        return False
    return True


def _destroy_at_exit() -> None:
    """The group left to the script's code after the function, at the interpreter's exit."""
    with contextlib.suppress(Exception):
        if torch.distributed.is_initialized():
            userpg.ORIGINAL_DESTROY()
