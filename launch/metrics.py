"""The job's Prometheus metrics, computed from a :class:`~peerckpt.launch.view.JobView` at
every scrape (``peerckpt run --metrics-port``; docs/observability.md lists them).

A custom collector, not metric objects updated as things happen: the coordinator already
holds every count (failure events, per-node counters its agents send with their heartbeats),
and the launcher keeps what a restarted coordinator forgets, so a scrape reads one
consistent view and nothing can drift. Counters are monotonic because their sources are:
the job's failure events are only appended, and each node's counters belong to one agent
process for the life of the job (a node index is never reused).

Labels: ``job`` on every series; ``node``, ``rank``, ``kind``, ``phase`` and ``state`` where
they apply. Every label value is bounded by the job's size or a fixed list; no step number,
pid or free text is ever a label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from peerckpt.launch.view import PHASES, JobView, RepairKind
from peerckpt.states import FlushState, JobState

# Seconds: a local rank restart is tens of milliseconds, a node loss waits for a heartbeat
# timeout, a cold start from storage can take minutes.
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# The states a job's gauge shows (RESTARTING is a launcher's passing view, never a job's).
JOB_STATES = tuple(s for s in JobState if s is not JobState.RESTARTING)


def _histogram(values: tuple[float, ...]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative buckets (+Inf last) and the sum of ``values``."""
    buckets = [(repr(b), float(sum(1 for v in values if v <= b))) for b in BUCKETS]
    buckets.append(("+Inf", float(len(values))))
    return buckets, float(sum(values))


class JobCollector(Collector):
    """Yields the job's metric families from ``source()``, the job's view now (None before
    the first status arrived: no series then)."""

    def __init__(self, source: Callable[[], JobView | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        view = self._source()
        if view is None:
            return
        job = [view.job]

        def gauge(name: str, doc: str, value: float | None, *labels: str) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=["job", *labels] if labels else ["job"])
            if value is not None:
                g.add_metric(job, value)
            return g

        yield gauge(
            "peerckpt_committed_step",
            "The last step every rank has replicated to all its buddies (what a failure restores).",
            view.committed_step,
        )
        yield gauge("peerckpt_epoch", "The current membership epoch.", view.epoch)
        yield gauge("peerckpt_world_size", "Ranks in the current epoch.", view.world_size)
        yield gauge(
            "peerckpt_durable_step",
            "The newest step committed to durable storage.",
            view.durable_step,
        )
        yield gauge("peerckpt_spares", "Hot spare processes waiting to take a rank.", view.spares)
        yield gauge(
            "peerckpt_recovering", "1 while a recovery is under way, else 0.", int(view.recovering)
        )
        state = GaugeMetricFamily(
            "peerckpt_job_state", "1 for the job's current state.", labels=["job", "state"]
        )
        for s in JOB_STATES:
            state.add_metric([view.job, s.value], float(view.state is s))
        yield state

        recoveries = CounterMetricFamily(
            "peerckpt_recoveries",
            "Recoveries finished (every rank stepping again), by kind: rank (a process "
            "replaced), node (a node's ranks replaced), reshard (the world changed size), "
            "storage (state read from durable storage).",
            labels=["job", "kind"],
        )
        for kind in RepairKind:
            recoveries.add_metric([view.job, kind.value], float(view.recoveries_total[kind]))
        yield recoveries
        seconds = HistogramMetricFamily(
            "peerckpt_recovery_seconds",
            "Time a recovery took, by phase: detection (fault → decision; injected faults "
            "only), transfer (obtaining the lost state), restore (the rest, until every rank "
            "steps again), total (fault, else detection → every rank stepping again).",
            labels=["job", "phase"],
        )
        for phase in (*PHASES, "total"):
            buckets, total = _histogram(view.phase_seconds[phase])
            seconds.add_metric([view.job, phase], buckets, total)
        yield seconds
        flushes = CounterMetricFamily(
            "peerckpt_durable_flushes",
            "Flushes of a committed step to durable storage, by outcome.",
            labels=["job", "state"],
        )
        for outcome in (FlushState.COMMITTED, FlushState.FAILED):
            flushes.add_metric([view.job, outcome.value], float(view.flushes.get(outcome, 0)))
        yield flushes

        by_node = {
            "snapshot_bytes": CounterMetricFamily(
                "peerckpt_snapshot_bytes",
                "Bytes of snapshots the node's ranks took.",
                labels=["job", "node"],
            ),
            "snapshots": CounterMetricFamily(
                "peerckpt_snapshots", "Snapshots the node's ranks took.", labels=["job", "node"]
            ),
            "replicated_bytes": CounterMetricFamily(
                "peerckpt_replicated_bytes",
                "Bytes the node pushed to buddies and had acknowledged (once per buddy).",
                labels=["job", "node"],
            ),
        }
        memory = GaugeMetricFamily(
            "peerckpt_memory_bytes",
            "Shared memory the node's agent holds, by kind: slots (its ranks' snapshots), "
            "replicas (copies kept for other nodes), staging (buffers of a restore).",
            labels=["job", "node", "kind"],
        )
        up = GaugeMetricFamily(
            "peerckpt_node_up", "1 while the node's agent is alive.", labels=["job", "node"]
        )
        for n in view.nodes:
            node = str(n.node)
            up.add_metric([view.job, node], float(n.alive))
            by_node["snapshot_bytes"].add_metric([view.job, node], float(n.snapshot_bytes))
            by_node["snapshots"].add_metric([view.job, node], float(n.snapshots))
            by_node["replicated_bytes"].add_metric([view.job, node], float(n.replicated_bytes))
            for kind, nbytes in sorted(n.memory.items()):
                memory.add_metric([view.job, node, kind], float(nbytes))
        yield from by_node.values()
        yield memory
        yield up

        lag = GaugeMetricFamily(
            "peerckpt_replication_lag_steps",
            "The rank's newest snapshot step minus the committed step: steps a failure now "
            "would train again.",
            labels=["job", "rank"],
        )
        copies = GaugeMetricFamily(
            "peerckpt_committed_copies",
            "Copies of the rank's committed step in memory (the invariant wants replicas+1).",
            labels=["job", "rank"],
        )
        for r in view.ranks:
            if r.lag is not None:
                lag.add_metric([view.job, str(r.rank)], float(r.lag))
            copies.add_metric([view.job, str(r.rank)], float(sum(1 for c in r.copies if c >= 0)))
        yield lag
        yield copies


def registry(source: Callable[[], JobView | None]) -> CollectorRegistry:
    """A registry holding only the job's metrics (no process or platform collectors: the
    launcher's own CPU time says nothing about the job)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(JobCollector(source))
    return reg
