"""The job as the coordinator sees it: its settings, its state, and its spares.

``Settings`` are what the coordinator decides with (rank 0's decorator may fill some);
``JobLife`` holds the ``JobState`` and is the one way to end the job (every agent is told);
``Spares`` counts the spares launchers started and those that joined. State only; the
coordinator changes them under its lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from peerckpt.messages.control import Shutdown
from peerckpt.recovery.placement import Placement
from peerckpt.recovery.registry import Registry
from peerckpt.states import JOB, JobState

log = logging.getLogger("peerckpt.coordinator")


@dataclass
class Settings:
    """The job's settings the coordinator decides with (rank 0's decorator may fill some)."""

    job: str
    world_size: int
    replicas: int | None
    heartbeat_timeout: float
    store_addr: str
    min_nodes: int | None  # None: the world never shrinks
    placement: Placement
    restart_based: bool = False  # torchrun: every worker restarts after any failure
    max_restarts: int = 0  # restarts in place per rank over the job (0: its launcher starts none)
    stall_timeout: float | None = None  # a rank stuck outside collectives this long is fenced
    # Rank 0's tracked objects that cannot follow a change of world size (its
    # ``Unreshardable`` report): while there are any, the world neither shrinks nor grows.
    unreshardable: tuple[str, ...] = ()


class JobLife:
    """The job's state (``JobState``) and the one way to end it."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.state = JobState.STARTING
        self.reason = ""

    def become(self, state: JobState, reason: str = "") -> None:
        self.state = JOB.check(self.state, state)
        self.reason = reason or self.reason

    def end(self, state: JobState, reason: str) -> None:
        """End the job (unless it has ended) and tell every agent."""
        if self.state.ended:
            return
        if state is JobState.FAILED:
            log.error("job failed: %s", reason)
        self.become(state, reason)
        self.registry.broadcast(Shutdown(state, reason))

    def fail(self, reason: str) -> None:
        self.end(JobState.FAILED, reason)


@dataclass
class Spares:
    """Spares started by launchers, and how many of them joined."""

    started: int
    joined: int = 0

    @property
    def starting(self) -> int:
        return self.started - self.joined
