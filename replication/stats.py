"""What an agent tells the coordinator about its node with every heartbeat, for observability.

Counters only grow for the life of the agent process: bytes of snapshots its ranks took,
bytes it pushed to buddies (one count per buddy that acknowledged), and the newest snapshot
step of each local rank. The memory its arena holds is read from the slot store when the
heartbeat is sent. The coordinator keeps the last report of each node and returns it in
``Status``; the launcher turns it into metrics (``launch/metrics.py``).

It never decides anything and is never read back by the agent: a lost report costs a graph
a point, nothing else.
"""

from __future__ import annotations

import threading

from peerckpt.messages.control import NodeStats
from peerckpt.messages.local import Beat
from peerckpt.replication.store import SlotStore

# Slot kinds as the metrics name them: a rank's own ping-pong slots, the copies kept for
# other nodes, and the transient buffers of a restore.
_MEMORY_KINDS = {"own": "slots", "replica": "replicas", "staging": "staging"}


class NodeCounters:
    """Monotonic counters of one agent; every method is safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.snapshot_bytes = 0
        self.snapshots = 0
        self.replicated_bytes = 0
        # local rank → (epoch, step) of its newest snapshot: after a restore a rank trains
        # older steps again, and its newest is the one of the newest epoch.
        self.latest: dict[int, tuple[int, int]] = {}

    def snapshot(self, epoch: int, rank: int, step: int, nbytes: int) -> None:
        """A local rank wrote its snapshot of ``step`` (``nbytes`` used in its slot)."""
        with self._lock:
            self.snapshot_bytes += nbytes
            self.snapshots += 1
            self.latest[rank] = max((epoch, step), self.latest.get(rank, (-1, -1)))

    def replicated(self, nbytes: int) -> None:
        """A buddy acknowledged a snapshot of ``nbytes`` pushed to it."""
        with self._lock:
            self.replicated_bytes += nbytes


def node_stats(
    store: SlotStore, counters: NodeCounters, ranks: list[int], beats: list[Beat] | None = None
) -> NodeStats:
    """The heartbeat's ``stats``: counters, the newest step of the node's current ``ranks``,
    the bytes its arena holds by kind (``slots``, ``replicas``, ``staging``), and from its
    processes' last ``beats`` the step each rank's loop runs and the loop's total."""
    live = {b.rank: b.step for b in beats or [] if b.rank is not None and b.step is not None}
    totals = [b.total for b in beats or [] if b.total is not None]
    memory = dict.fromkeys(_MEMORY_KINDS.values(), 0)
    for slot in store.all():
        memory[_MEMORY_KINDS.get(slot.kind.value, slot.kind.value)] += slot.segment.size
    with counters._lock:
        return NodeStats(
            snapshot_bytes=counters.snapshot_bytes,
            snapshots=counters.snapshots,
            replicated_bytes=counters.replicated_bytes,
            latest_step={r: s for r, (_, s) in counters.latest.items() if r in ranks},
            memory=memory,
            live_step=live,
            steps_total=max(totals) if totals else None,
        )
