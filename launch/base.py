"""The launcher interface: what every way of starting a job offers, whatever its backend.

A launcher starts a job's processes (coordinator, one agent per node, ranks, spares), watches
the job until it ends, and stops everything it started, whatever happened. Backends: local
simulated nodes (``launch/local.py``), one host of a multi-host job, plain torchrun, Ray.

Call order: ``run()`` (which calls ``start()``, then watches the job, then ``stop()``, always)
returns the :class:`JobResult`. While the job runs, a fault injector may ask the launcher for
the machine-level faults only it can cause in its backend: ``kill_node``, ``kill_agent``,
``kill_coordinator``, and the growth ``add_node``.
"""

from __future__ import annotations

import abc
import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from peerckpt.launch.checks import check_spec
from peerckpt.states import ExitCode, JobState

log = logging.getLogger("peerckpt.launcher")


@dataclass
class JobSpec:
    """What ``peerckpt run`` was asked to do."""

    script: str
    args: list[str] = field(default_factory=list)
    nodes: int = 2
    nproc_per_node: int = 2
    spares: int = 0
    replicas: int | None = None
    chaos: str = ""
    heartbeat_timeout: float = 5.0
    start_timeout: float = 300.0
    min_nodes: int | None = None
    # A rank process lost on a live node, with no spare free: restarted there, from its
    # node's memory, at most this many times per rank over the job (torchrun's default)
    max_restarts: int = 3
    report: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # --env: set for every process
    job: str | None = None
    persist: dict[str, Any] | None = None  # PersistConfig.to_msg(), from --persist
    placement: str = "ring"
    racks: dict[int, str] | None = None  # node → rack
    erasure: str | None = None  # "K+M": parity over groups instead of buddy replicas
    keep_spares: bool = False  # start a new spare (and spare node) for every one used or lost
    record_digests: bool = False  # every snapshot's tensor digest, in the result
    metrics_port: int | None = None  # serve /metrics and /status here (0: any free port)
    metrics_addr: str = "127.0.0.1"

    def check(self) -> None:
        """Refuse settings that cannot work, before anything starts: a ConfigurationError
        naming the flag and the fix (``launch/checks.py`` holds the rules). The durable
        location last, once every flag passed: its probe makes the root and writes there."""
        check_spec(self)
        from peerckpt.persist.config import PersistConfig
        from peerckpt.persist.location import check_writable

        config = PersistConfig.from_msg(self.persist)
        if config is not None:
            # StorageUnusable (a ConfigurationError) names the URL and the fix; the URL
            # would otherwise hang the first epoch or fail every flush (docs/durable.md).
            check_writable(config.url, config.mode)

    @property
    def world(self) -> int:
        """The first epoch's world size: every rank the job starts with."""
        return self.nodes * self.nproc_per_node


class JobOutcome(enum.Enum):
    """How a job ended, as its launcher reports it: the coordinator's end state, or
    ``INTERRUPTED`` when a signal stopped the launcher itself."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # the coordinator was told to stop the job
    INTERRUPTED = "interrupted"  # the launcher was stopped by a signal (Ctrl-C)

    @classmethod
    def of(cls, state: JobState) -> JobOutcome:
        """The outcome of a job that ended in ``state`` (one of the ended states)."""
        return cls(state.value)

    @property
    def exit_code(self) -> int:
        """The launcher's exit status for this outcome."""
        if self is JobOutcome.SUCCEEDED:
            return int(ExitCode.OK)
        return int(ExitCode.INTERRUPTED if self is JobOutcome.INTERRUPTED else ExitCode.FAILED)


@dataclass
class JobResult:
    """How a job ended and what happened on the way: the report (``to_json``)."""

    job: str
    exit_code: int
    state: JobOutcome
    reason: str
    events: list[dict[str, Any]]
    chaos: list[dict[str, Any]]
    wall_s: float
    flushes: list[dict[str, Any]] = field(default_factory=list)  # durable checkpoints written
    digests: dict[str, list[str]] = field(default_factory=dict)  # "rank/step" → digests seen
    timeline: dict[str, Any] = field(default_factory=dict)  # JobMonitor.timeline()
    unfired: list[str] = field(default_factory=list)  # a line per chaos action that never fired
    # "rank/step/digest" → that snapshot's tensor digests by key (with ``record_digests``)
    tensor_digests: dict[str, dict[str, str]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)  # report.summarize: what protected it

    def to_json(self) -> dict[str, Any]:
        """The report's JSON form (``peerckpt run --report``): every field, the state as
        its string."""
        return {**self.__dict__, "state": self.state.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobResult:
        """A result read back from its JSON form (a Ray host's, a report file)."""
        return cls(**{**data, "state": JobOutcome(data["state"])})


def chaos_verdict(state: JobOutcome, reason: str, unfired: list[str]) -> tuple[JobOutcome, str]:
    """A chaos run that did not fire every action tested less than it was asked to: it fails,
    with a line per action that never fired (logged here), even when the job succeeded."""
    for line in unfired:
        log.error("%s", line)
    if not unfired or state is not JobOutcome.SUCCEEDED:
        return state, reason
    more = f" (and {len(unfired) - 1} more)" if len(unfired) > 1 else ""
    return JobOutcome.FAILED, f"the job succeeded, but {unfired[0]}{more}"


class Launcher(abc.ABC):
    """One job, started and stopped by one backend."""

    job: str  # the job's name: its processes' PEERCKPT_JOB, its shared-memory prefix
    run_id: str  # this run's random id: its processes' PEERCKPT_RUN, in every segment's name

    @abc.abstractmethod
    def run(self) -> JobResult:
        """Start the job, watch it until it ends, stop everything; return how it ended."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop every process of the job and remove its files. Idempotent."""

    @abc.abstractmethod
    def kill_node(self, node: int) -> None:
        """Lose node ``node`` as a machine failure would: its agent, its ranks, its memory."""

    @abc.abstractmethod
    def kill_agent(self, node: int) -> None:
        """Lose node ``node``'s agent only (its ranks see it go and exit)."""

    @abc.abstractmethod
    def kill_coordinator(self) -> None:
        """Lose the coordinator (the launcher brings a new one up)."""

    @abc.abstractmethod
    def add_node(self) -> int:
        """Start one more node that joins the running job; return its index."""
