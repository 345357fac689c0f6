"""The launcher interface: what every way of starting a job offers, whatever its backend.

A launcher starts a job's processes (coordinator, one agent per node, ranks, spares), watches
the job until it ends, and stops everything it started, whatever happened. Backends: local
simulated nodes (``launch/local.py``), one host of a multi-host job, plain torchrun, Ray.

Call order: ``run()`` is the one sequence every backend follows (``Launcher.run`` says it step
by step: start, chaos, the watch loop, stop always, the result, the report); a backend supplies
``start``, ``_watch``, ``_result`` and ``stop``, and may hook ``_prepare``, ``_wind_down``,
``_unfired`` and ``_on_signal``. It returns the :class:`JobResult`. While the job runs, a fault injector may ask the launcher for
the machine-level faults only it can cause in its backend: ``kill_node``, ``kill_agent``,
``kill_coordinator``, and the growth ``add_node``.
"""

from __future__ import annotations

import abc
import enum
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from peerckpt.chaos import FiredAction
from peerckpt.errors import PeerckptError
from peerckpt.launch.checks import check_spec
from peerckpt.messages import encode
from peerckpt.messages.control import FlushRecord, RecoveryEvent
from peerckpt.outfiles import write_private
from peerckpt.states import ExitCode, JobState

if TYPE_CHECKING:
    from peerckpt.chaos import Chaos
    from peerckpt.rpc import RpcClient

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
    # A rank whose step has not moved for this long, in no collective and using no CPU, is
    # fenced and recovered (None: such a rank is only named; replication/stall.py)
    stall_timeout: float | None = None
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
    INTERRUPTED = "interrupted"  # the launcher was stopped by a signal (Ctrl-C, SIGTERM)

    @classmethod
    def of(cls, state: JobState) -> JobOutcome:
        """The outcome of a job that ended in ``state`` (one of the ended states)."""
        return cls(state.value)

    @property
    def exit_code(self) -> int:
        """The launcher's exit status for this outcome (``INTERRUPTED``: Ctrl-C's; another
        signal's is ``stopped_by``'s)."""
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
    events: list[RecoveryEvent]  # every failure of the job, oldest first
    chaos: list[FiredAction]  # what every chaos action that came due did, in order
    wall_s: float
    flushes: list[FlushRecord] = field(default_factory=list)  # durable checkpoints written
    digests: dict[str, list[str]] = field(default_factory=dict)  # "rank/step" → digests seen
    timeline: dict[str, Any] = field(default_factory=dict)  # JobMonitor.timeline()
    unfired: list[str] = field(default_factory=list)  # a line per chaos action that never fired
    # "rank/step/digest" → that snapshot's tensor digests by key (with ``record_digests``)
    tensor_digests: dict[str, dict[str, str]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)  # report.summarize: what protected it

    def to_json(self) -> dict[str, Any]:
        """The report's JSON form (``peerckpt run --report``): every field, the state as
        its string, the events, flushes and chaos records as the maps they travel as."""
        return {
            **self.__dict__,
            "state": self.state.value,
            "events": [e.to_json() for e in self.events],
            "flushes": [encode(f) for f in self.flushes],
            "chaos": [c.to_json() for c in self.chaos],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobResult:
        """A result read back from its JSON form (a Ray host's, a report file)."""
        return cls(
            **{
                **data,
                "state": JobOutcome(data["state"]),
                "events": [RecoveryEvent.from_json(e) for e in data["events"]],
                "flushes": [FlushRecord.from_json(f) for f in data.get("flushes", [])],
                "chaos": [FiredAction.from_json(c) for c in data["chaos"]],
            }
        )


def stopped_by(signum: int | None) -> tuple[int, str]:
    """The exit status and the reason of a launcher stopped by signal ``signum``: 128 + the
    signal's number, as shells and torchrun report it (Ctrl-C, SIGINT: 130; SIGTERM: 143).
    ``None``: a stop asked without a signal of its own (a Ray host's, told by its driver),
    reported as Ctrl-C."""
    if signum is None or signum == signal.SIGINT:
        return int(ExitCode.INTERRUPTED), "stopped by a signal (Ctrl-C)"
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return 128 + signum, f"stopped by {name}"


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
    spec: JobSpec
    chaos: Chaos | None  # the faults this launcher injects itself, if any
    rpc: RpcClient | None  # the coordinator's client, once started
    _fault_dir: str | None  # where the chaos monkey's fault files go, if it needs one
    _interrupted: threading.Event  # a signal asked the launcher to stop
    _signal: int | None = None  # the first signal that did (``stopped_by``)

    def run(self) -> JobResult:
        """Start the job, watch it until it ends, stop everything; return how it ended.

        The sequence, the same for every backend: SIGINT and SIGTERM go to ``_on_signal``
        (in the main thread); ``_prepare``; ``start``; the chaos monkey starts; ``_watch``
        until the job ends, which says how; then, whatever happened (an error of the
        launcher's own is logged and fails the job), the chaos monkey stops first (it thaws
        what it froze), ``_wind_down`` collects what ``stop`` removes, ``stop`` ends every
        process, and the signal handlers are put back. ``_result`` builds the result, a
        chaos action that never fired fails it (``chaos_verdict``), and the report is
        written (``--report``).
        """
        started = time.time()
        outcome, reason = JobOutcome.FAILED, ""
        previous = (
            {
                sig: signal.signal(sig, lambda s, f: self._on_signal(s))
                for sig in (signal.SIGINT, signal.SIGTERM)
            }
            if threading.current_thread() is threading.main_thread()
            else {}
        )
        try:
            self._prepare()
            self.start()
            if self.chaos is not None:
                assert self.rpc is not None
                self.chaos.start(self, self.rpc, self._fault_dir)
            outcome, reason = self._watch()
        except PeerckptError as exc:
            reason = str(exc)
            log.error("%s", exc)
        finally:
            if self.chaos is not None:
                self.chaos.stop()  # first: it thaws the processes it froze
            self._wind_down()
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        result = self._result(outcome, reason, time.time() - started)
        unfired = [line for line in self._unfired() if line not in result.unfired]
        result.unfired += unfired
        result.state, result.reason = chaos_verdict(result.state, result.reason, unfired)
        if result.state is JobOutcome.FAILED and result.exit_code == ExitCode.OK:
            result.exit_code = int(ExitCode.FAILED)
        if self.spec.report:
            write_private(self.spec.report, json.dumps(result.to_json(), indent=2, default=str))
        return result

    @abc.abstractmethod
    def start(self) -> None:
        """Start the job's processes (and the coordinator's client, ``rpc``)."""

    @abc.abstractmethod
    def _watch(self) -> tuple[JobOutcome, str]:
        """Watch the job until it ends (or a signal stops the launcher): how, and why."""

    @abc.abstractmethod
    def _result(self, outcome: JobOutcome, reason: str, wall_s: float) -> JobResult:
        """The job's result, once everything stopped: ``outcome`` and ``reason`` as
        ``_watch`` said (or the launcher's error), ``wall_s`` since ``run`` began."""

    def _prepare(self) -> None:
        """Before anything starts (a backend's observers)."""
        return

    def _wind_down(self) -> None:
        """After the chaos monkey stopped, before ``stop``: collect what ``stop`` removes."""
        return

    def _unfired(self) -> list[str]:
        """A line per chaos action that never fired."""
        return self.chaos.unfired() if self.chaos is not None else []

    def _on_signal(self, signum: int) -> None:
        """SIGINT or SIGTERM: stop the job (the first one is the one reported)."""
        if self._signal is None:
            self._signal = signum
        self._interrupted.set()

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
