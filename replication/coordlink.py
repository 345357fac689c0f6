"""The agent's link to the coordinator: reports, heartbeats, and rejoining a restarted one.

A coordinator restarted in place answers where the last one did; one that moved to another
host because its own died answers at the next endpoint of the job's succession
(``peerckpt/succession.py``): ``rejoin`` tries them in that order.

An agent that starts while the coordinator is away (a spare node or a joiner the launcher
started just before the coordinator died) is in the same position as one that lost it:
``register`` waits and retries for the coordinator's grace period, as ``rejoin`` does,
instead of failing the node (and with it the launcher's job) at the first refused connection.
Only silence is waited out: a coordinator that answers with a refusal is final.

Every report is a typed request (``peerckpt/messages/control.py``). The frequent ones
(replicated snapshots, heart-beats, ranks resumed or done, flushes written) travel on one
stream of calls per node (``peerckpt/rpcstream.py``): a call each cost the coordinator's
server three times the CPU, and at 1,000 nodes that was most of its core. While the chaos harness
partitions the node, reports wait until it heals (a partitioned node's coordinator hears
nothing). The last report of each kind per rank is kept, and sent again when the agent
registers with a restarted coordinator, which rebuilds its state from what agents tell it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from peerckpt.errors import PeerckptError, PeerUnavailable
from peerckpt.faults import NetHooks
from peerckpt.messages.control import (
    AgentConfig,
    Done,
    Flushed,
    Heartbeat,
    ProcJoined,
    RegisterAgent,
    RejoinState,
    Replicated,
    ReplicatedMany,
    Request,
    Resumed,
    SparesStarting,
    Watch,
)
from peerckpt.rpc import EventStream, RpcClient
from peerckpt.rpcstream import CallStream

log = logging.getLogger("peerckpt.agent")
R = TypeVar("R")
RETRY_S = 0.2  # between two registrations while the coordinator is away
REGISTER_TIMEOUT_S = 10.0  # one registration call, the coordinator answering
# Calls sent on the node's stream: frequent, and answered by the coordinator without waiting.
STREAMED = frozenset(
    {Heartbeat, ProcJoined, SparesStarting, Replicated, ReplicatedMany, Resumed, Done, Flushed}
)


class CoordinatorLink:
    """Calls to the coordinator on behalf of node ``node``."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        job: str,
        node: int,
        stopping: threading.Event,
        net: NetHooks | None = None,
        succession: Callable[[str], list[str]] | None = None,
    ) -> None:
        self.address = address
        self.rpc = RpcClient(address, secret, job)
        self._secret, self._job = secret, job
        # current endpoint → where a coordinator may answer, in order (it first)
        self._succession = succession or (lambda current: [current])
        self.node = node
        self._stopping = stopping
        self._net = net
        # The last report of each kind per local rank, sent again to a restarted coordinator.
        self._resend: dict[tuple[str, int], Request[Any]] = {}
        self._lock = threading.Lock()
        self._ready: list[Replicated] = []  # reports waiting for the one on its way
        self._reporting = False  # a thread is sending reports
        # (epoch, rank) → the chunk layout a report carried that the coordinator did not
        # take: Mirroring sends a layout once per epoch, and without every rank's the
        # coordinator commits nothing more in that epoch, so the next report carries it.
        # Either form: records (``layout``) or columns (``columns``, what Mirroring sends).
        self._layouts_owed: dict[tuple[int, int], tuple[list[Any] | None, Any]] = {}
        # When the coordinator last took a replicated-snapshot report from this node: it
        # counts as a heart-beat, so a training node sends few others.
        self.reported_at = float("-inf")
        self._calls: tuple[RpcClient, CallStream] | None = None  # the stream and its client
        self._calls_lock = threading.Lock()
        self._unary_only = False  # the coordinator has no stream of calls

    def call(self, msg: Request[R], timeout: float = 10.0) -> R:
        """Call the coordinator: on the node's stream for ``STREAMED`` calls, else alone."""
        if type(msg) not in STREAMED or self._unary_only:
            return self.rpc.call(msg, timeout=timeout)
        stream = self._stream()
        try:
            return stream.call(msg, timeout=timeout)
        except PeerUnavailable:
            if not stream.unsupported:
                raise
            self._unary_only = True
            log.info("the coordinator takes no stream of calls: calling it call by call")
            return self.rpc.call(msg, timeout=timeout)

    def _stream(self) -> CallStream:
        """The open stream of calls to the current coordinator (a new one if it ended)."""
        with self._calls_lock:
            if self._calls is not None:
                rpc, stream = self._calls
                if rpc is self.rpc and stream.broken is None:
                    return stream
                stream.close()
            stream = self.rpc.call_stream()
            self._calls = (self.rpc, stream)
            return stream

    def register(self, msg: RegisterAgent, grace_s: float) -> AgentConfig:
        """Register this node's agent for the first time. While the coordinator does not
        answer (the launcher may be restarting it), wait and retry for up to ``grace_s``;
        a refusal raises at once. Raises ``PeerUnavailable`` naming the wait if it never
        answered, ``PeerckptError`` if the agent is told to stop meanwhile."""
        began = time.monotonic()
        deadline = began + grace_s
        waiting = False
        while True:
            left = deadline - time.monotonic()
            try:
                config = self.rpc.call(msg, timeout=max(1.0, min(REGISTER_TIMEOUT_S, left)))
                break
            except PeerUnavailable as exc:
                if time.monotonic() + RETRY_S > deadline:
                    raise PeerUnavailable(
                        f"node {self.node}'s agent could not register: the coordinator at "
                        f"{self.address} did not answer for {grace_s:.0f} s ({exc}). Is the "
                        "job's coordinator running there? A restarted one is back within "
                        "seconds; check its log and the --coordinator address"
                    ) from None
                if not waiting:
                    log.warning(
                        "the coordinator at %s does not answer (it may be restarting): "
                        "retrying for up to %.0f s",
                        self.address,
                        grace_s,
                    )
                    waiting = True
            if self._stopping.wait(RETRY_S):
                raise PeerckptError(
                    f"node {self.node}'s agent was stopped while it waited for the coordinator"
                )
        if waiting:
            log.warning(
                "registered with the coordinator after waiting %.1f s for it",
                time.monotonic() - began,
            )
        return config

    def watch(self) -> EventStream:
        return self.rpc.stream(Watch(self.node))

    def remember(self, key: tuple[str, int], msg: Request[Any]) -> None:
        """Keep ``msg`` (the last of its kind for a rank) to replay to a restarted coordinator."""
        with self._lock:
            self._resend[key] = msg

    def report(self, msg: Request[Any]) -> bool:
        """Send a report; a refusal is logged, not raised (the coordinator decides). True if
        the coordinator took it."""
        if self._net is not None:
            self._net.wait_healed(self._stopping)
        try:
            self.call(msg)
            return True
        except PeerckptError as exc:
            log.warning("coordinator refused %s: %s", type(msg).__name__, exc)
        except ValueError as exc:  # grpc: the channel was closed because the agent is exiting
            log.debug("could not report %s: %s", type(msg).__name__, exc)
        return False

    def report_replicated(self, msg: Replicated) -> None:
        """Report a replicated snapshot. Reports that become ready while one is on its way
        go together in the next call (one ``ReplicatedMany``): a node's ranks, which finish
        a step together, cost the coordinator one or two calls a step instead of one each,
        and no report waits for more than the call before it. Never blocks a caller while
        another thread is sending; that thread sends what queued up."""
        with self._lock:
            self._ready.append(msg)
            if self._reporting:
                return
            self._reporting = True
        try:
            while True:
                with self._lock:
                    ready, self._ready = list(map(self._with_layout, self._ready)), []
                    if not ready:
                        self._reporting = False
                        return
                if self.report(ready[0] if len(ready) == 1 else ReplicatedMany(self.node, ready)):
                    self.reported_at = time.monotonic()  # it counts as a heart-beat
                    continue
                with self._lock:  # not taken (refused, timed out): the layouts are owed
                    for msg in ready:
                        if msg.layout is not None or msg.columns is not None:
                            owed = (msg.layout, msg.columns)
                            self._layouts_owed[(msg.epoch, msg.rank)] = owed
        except BaseException:
            with self._lock:
                self._reporting = False
            raise

    def _with_layout(self, msg: Replicated) -> Replicated:
        """``msg``, carrying its rank's layout if an earlier report of the epoch failed with
        it (a layout of its own supersedes it). Holds ``_lock``."""
        owed = self._layouts_owed
        for key in [k for k in owed if k[0] < msg.epoch]:
            del owed[key]  # an epoch that is over needs none
        layout = owed.pop((msg.epoch, msg.rank), None)
        if layout is None or msg.layout is not None or msg.columns is not None:
            return msg
        return replace(msg, layout=layout[0], columns=layout[1])

    def rejoin(
        self,
        grace_s: float,
        register: Callable[[RejoinState], RegisterAgent],
        state: Callable[[], RejoinState],
    ) -> AgentConfig | None:
        """Register again with a restarted coordinator, telling it what this node knows, and
        replay the last reports. None if it did not come back in ``grace_s`` or counts this
        node as lost (``AgentConfig.lost``)."""
        log.warning("waiting up to %.0f s for the coordinator to come back", grace_s)
        deadline = time.monotonic() + grace_s
        while not self._stopping.wait(0.2):
            if time.monotonic() > deadline:
                log.error("the coordinator did not come back within %.0f s", grace_s)
                return None
            try:
                config = self._register_anywhere(register(state()))
            except PeerckptError as exc:
                log.debug("coordinator not back yet: %s", exc)
                continue
            if config.lost:
                log.warning("the restarted coordinator counts this node as lost")
                return config
            log.warning("registered again with the restarted coordinator")
            with self._lock:
                replay = list(self._resend.values())
            for msg in replay:
                self.report(msg)
            return config
        return None

    def _register_anywhere(self, msg: RegisterAgent) -> AgentConfig:
        """Register at the first endpoint of the succession that answers, and keep calling
        that one. Raises the last endpoint's error if none answers."""
        error: PeerckptError | None = None
        for address in self._succession(self.address):
            moved = address != self.address
            rpc = RpcClient(address, self._secret, self._job) if moved else self.rpc
            try:
                config = rpc.call(msg, timeout=2.0)
            except PeerckptError as exc:
                if moved:
                    rpc.close()
                error = exc
                continue
            if moved:
                old, self.rpc, self.address = self.rpc, rpc, address
                old.close()
                log.warning("the coordinator moved: it answers at %s now", address)
            return config
        assert error is not None
        raise error

    def close(self) -> None:
        with self._calls_lock:
            if self._calls is not None:
                self._calls[1].close()
                self._calls = None
        self.rpc.close()
