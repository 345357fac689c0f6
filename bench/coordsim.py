"""The simulated nodes of ``bench/coordinator.py``: many agents per process, speaking the
real protocol through ``peerckpt/rpc.py`` (``AsyncRpcClient``), one connection per node.

Each registers, holds its ``Watch`` stream, reports its ranks, waits for epoch 0, heart-beats
as the agent does, and at every step reports its ranks' snapshots; it records when it saw
each commit. Reports and heart-beats travel on the node's stream of calls, as the agent's
(``peerckpt/rpcstream.py``), or each as a call of its own (``streamed`` False: as before).
Benchmark code: nothing here is imported by the package.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from peerckpt.codec import unpack
from peerckpt.errors import PeerckptError
from peerckpt.manifest import META_KEY, ChunkRecord
from peerckpt.membership import Membership
from peerckpt.messages import decode
from peerckpt.messages.control import (
    Commit,
    EpochOpened,
    Event,
    Heartbeat,
    ProcJoined,
    ProcReport,
    RegisterAgent,
    Replicated,
    ReplicatedMany,
    Shutdown,
    Watch,
)
from peerckpt.rpc import AsyncRpcClient
from peerckpt.states import JobState, ProcRole

SPREAD_S = 0.02  # nodes finish a step's replication this far apart (uniformly)
TENSORS = 8  # chunks in each rank's layout (sent with its first report)


def _layout(rank: int) -> list[Any]:
    chunks = [
        ChunkRecord(f"layer{i}.weight", "bfloat16", (4096, 8), (0, 0), (4096, 8), i << 16, 1 << 16)
        for i in range(TENSORS)
    ]
    chunks.append(
        ChunkRecord(META_KEY, "uint8", (64,), (0,), (64,), TENSORS << 16, 64, None, "rank")
    )
    return [c.to_msg() for c in chunks]


_DECODED: dict[bytes, Any] = {}  # an event's bytes → the event, decoded once per process


def _decode_once(packed: bytes) -> Any:
    """An event as ``decode`` makes it, decoded once per process of simulated nodes: the same
    event (an epoch's membership of thousands of ranks, 9 ms to unpack at 8,000) reaches every
    node, and each real agent decodes it once, on its own machine."""
    event = _DECODED.get(packed)
    if event is None:
        event = decode(unpack(packed), Event)
        if len(_DECODED) > 64:
            _DECODED.clear()
        _DECODED[packed] = event
    return event


class Node:
    """One simulated node's agent: its channel, stream, heart-beats and reports."""

    def __init__(self, node: int, ranks: list[int], address: str, secret: bytes, job: str) -> None:
        self.node, self.ranks = node, ranks
        self.rpc = AsyncRpcClient(address, secret, job)
        self.membership: Membership | None = None
        self.opened = asyncio.Event()
        self.commits: dict[int, float] = {}  # step → when this node saw it committed
        self.heartbeats: list[float] = []  # round trips
        self.failed_beats = 0
        self.beat_errors: list[str] = []  # the first few, for the report
        self.max_gap = 0.0  # the longest time between two heart-beats sent
        self.reported_at = float("-inf")  # the last report the coordinator took
        self.beat_skip_s = 0.0  # heartbeat_timeout / 5: a report this recent stands for a beat
        self.lost = False
        self.layouts_owed = True  # as the agent: until a report with them was taken
        self.calls: Any = None  # the node's stream of calls, or its channel (one call each)

    async def call(self, msg: Any, timeout: float) -> Any:
        if self.calls is not self.rpc and self.calls.broken is not None:
            self.calls.close()  # as the agent: a stream that ended is opened again
            self.calls = self.rpc.call_stream()
        return await self.calls.call(msg, timeout=timeout)

    async def join(self, heartbeat_interval: float, until: list[float], streamed: bool) -> None:
        await self.rpc.call(
            RegisterAgent(self.node, f"10.{self.node >> 8}.{self.node & 255}.1:29400")
        )
        self.calls = self.rpc.call_stream() if streamed else self.rpc
        self.watching = asyncio.create_task(self.watch())
        self.beating = asyncio.create_task(self.heartbeat(heartbeat_interval, until))
        for rank in self.ranks:
            await self.call(
                ProcJoined(self.node, ProcReport(100_000 + rank, ProcRole.RANK, rank)), 10.0
            )

    async def watch(self) -> None:
        async for event in self.rpc.stream(Watch(self.node), _decode_once):
            if isinstance(event, Commit):
                self.commits.setdefault(event.step, time.monotonic())
            elif isinstance(event, EpochOpened):
                self.membership = event.membership
                self.opened.set()
            elif isinstance(event, Shutdown):
                self.lost = event.state is JobState.FAILED
                return

    async def heartbeat(self, interval: float, until: list[float]) -> None:
        """Beat as the agent does from its registration until ``until[0]``; the round trips
        are kept from ``until[1]`` (the measured steps)."""
        await asyncio.sleep(random.uniform(0, interval))
        last = time.monotonic()
        while time.monotonic() < until[0]:
            start = time.monotonic()
            self.max_gap = max(self.max_gap, start - last)
            last = start
            if start - self.reported_at < self.beat_skip_s:  # as the agent: a report stood
                await asyncio.sleep(interval)  # for this heart-beat
                continue
            try:
                await self.call(Heartbeat(self.node, 0), timeout=2.0)  # as the agent
            except PeerckptError as exc:
                self.failed_beats += 1  # the agent logs it and beats again
                if len(self.beat_errors) < 3:
                    self.beat_errors.append(str(exc)[:200])
                continue
            if start >= until[1]:
                self.heartbeats.append(time.monotonic() - start)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))

    async def report(self, step: int, batched: bool) -> float:
        """Report every rank's snapshot of ``step``; when the last call started."""
        assert self.membership is not None
        place = self.membership.placement
        reports = [
            Replicated(
                self.node,
                0,
                r,
                step,
                [self.node, *place[r]],
                1 << 20,
                64,
                layout=_layout(r) if self.layouts_owed else None,
            )
            for r in self.ranks
        ]
        sent = time.monotonic()
        if batched:
            await self.call(ReplicatedMany(self.node, reports), timeout=30.0)
        else:
            calls = []
            for msg in reports:
                sent = time.monotonic()
                calls.append(asyncio.ensure_future(self.call(msg, timeout=30.0)))
            await asyncio.gather(*calls)
        self.layouts_owed = False  # a report that failed leaves them owed, as the agent does
        self.reported_at = time.monotonic()
        return sent


def simulate(
    nodes: list[int],
    per_node: int,
    address: str,
    secret: bytes,
    job: str,
    args: dict[str, Any],
    to_parent: Any,
    from_parent: Any,
) -> None:
    """A process of simulated nodes (``mp.Process`` target): join, step, send the times."""
    asyncio.run(_simulate(nodes, per_node, address, secret, job, args, to_parent, from_parent))


async def _simulate(
    nodes: list[int],
    per_node: int,
    address: str,
    secret: bytes,
    job: str,
    args: dict[str, Any],
    to_parent: Any,
    from_parent: Any,
) -> None:
    sims = [
        Node(n, list(range(n * per_node, (n + 1) * per_node)), address, secret, job) for n in nodes
    ]
    for sim in sims:
        sim.beat_skip_s = args["heartbeat_timeout"] / 5
    until = [float("inf"), float("inf")]  # heart-beats: when they end, when they are measured
    for i in range(0, len(sims), 50):  # joins in waves (a real cluster's agents start spread out)
        wave = sims[i : i + 50]
        joined = await asyncio.gather(
            *(s.join(args["heartbeat_interval"], until, args["streamed"]) for s in wave),
            return_exceptions=True,
        )
        for sim, error in zip(wave, joined, strict=True):
            if error is not None:
                raise SystemExit(f"node {sim.node} could not join: {error!r}")
    await asyncio.gather(*(s.opened.wait() for s in sims))
    to_parent.put(("ready", len(sims)))
    t0 = await asyncio.get_running_loop().run_in_executor(None, from_parent.get)
    steps, period = args["steps"], args["period"]
    until[1] = t0 + args["warmup"] * period
    sent: dict[int, float] = {}
    failed: list[int] = []  # steps of reports that failed (a deadline passed)
    cpu0 = time.process_time()

    async def one(sim: Node, step: int, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        try:
            t = await sim.report(step, args["batched"])
        except PeerckptError:
            failed.append(step)
            return
        sent[step] = max(sent.get(step, 0.0), t)

    offsets = {s.node: random.uniform(0, SPREAD_S) for s in sims}
    for step in range(steps):
        at = t0 + step * period
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        await asyncio.gather(*(one(s, step, at + offsets[s.node]) for s in sims))
    await asyncio.sleep(1.0)  # the last commits arrive
    cpu = time.process_time() - cpu0
    to_parent.put(
        (
            "done",
            {
                "sent": sent,
                "commits": {s.node: s.commits for s in sims},
                "heartbeats": [h for s in sims for h in s.heartbeats],
                "lost": sum(s.lost for s in sims),
                "failed_heartbeats": sum(s.failed_beats for s in sims),
                "heartbeat_errors": sorted({e for s in sims for e in s.beat_errors})[:5],
                "heartbeat_max_gap": max(s.max_gap for s in sims),
                "failed_reports": len(failed),
                "cpu_s": cpu,
            },
        )
    )
    await asyncio.get_running_loop().run_in_executor(None, from_parent.get)  # the end
    until[0] = 0.0
    await asyncio.gather(*(s.beating for s in sims))
    await asyncio.gather(*(s.calls.aclose() for s in sims if s.calls is not s.rpc))
    for s in sims:
        s.watching.cancel()
    await asyncio.gather(*(s.rpc.close() for s in sims), return_exceptions=True)
