"""The fault-hook interface: the places where a fault injector may act inside a process.

Production code never imports the chaos harness (``chaos/``). A process asks for its hooks
once, when it starts (:func:`load`), and hands the object to whatever offers a hook: the
snapshot engine, the replicator and the agent's recovery strike *phase points*; a rank's
step loop passes *step points*; the agent's TCP connections consult *network* hooks. Without an injector every hook is a no-op
(:data:`NO_FAULTS`), and the no-op costs one attribute read.

An injector registers a factory as an entry point of group ``peerckpt.faults`` (``chaos/``
does, in ``pyproject.toml``). :func:`load` calls it only when the launcher set
``PEERCKPT_FAULTS_DIR`` (the job's fault directory, which only a chaos run has); the factory
gets that directory, the process's node and whether it owns the node's links, and returns
the hooks.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Protocol

log = logging.getLogger("peerckpt.faults")
ENV = "PEERCKPT_FAULTS_DIR"
GROUP = "peerckpt.faults"


class Cuttable(Protocol):
    """What network hooks can cut: a connection."""

    def close(self) -> None: ...


class NetHooks(Protocol):
    """Network faults of one node's agent (partition, slow links)."""

    def track(self, conn: Cuttable) -> None:
        """A new TCP connection; it is cut when a partition starts."""
        ...

    def check(self, peer: str) -> None:
        """Raise PeerUnavailable, as a cut connection would, while partitioned."""
        ...

    def slowed(self) -> bool:
        """Whether sends are paced now (``pace`` then sleeps)."""
        ...

    def pace(self, nbytes: int) -> None:
        """Sleep so that what is sent stays under the slowed link's rate."""
        ...

    def partitioned(self) -> bool:
        """Whether the node is cut off now (the agent then holds back its reports)."""
        ...

    def wait_healed(self, stop: threading.Event | None = None) -> None:
        """Block while partitioned (what TCP does to a message sent into a partition)."""
        ...

    def stop(self) -> None:
        """Stop watching for faults."""
        ...


class FaultHooks:
    """A process's fault hooks. This base class injects nothing."""

    #: True where an injector is present (so callers may skip building hook arguments).
    active = False
    #: Network hooks for an agent's TCP links (None: no network faults).
    net: NetHooks | None = None

    def strike(self, phase: str, **where: Any) -> bool:
        """Reached phase ``phase`` at ``where`` (rank, node, step…): hold still here if a fault
        waits for it. True if one was struck."""
        return False

    def reach(self, step: int, check: Callable[[], None] | None = None, **where: Any) -> None:
        """A rank is about to run ``step`` (``step`` = the total: the loop ended). A fault
        injector that strikes at steps learns here that the job reached one, and holds the
        rank at the boundary after it until the fault was fired, so that a fault asked for
        at step S lands while the job runs S, however short the steps. ``check`` raises
        once the rank's epoch has ended: a hold ends with it (a node added at S joins while
        the ranks hold after S)."""

    def left(self, step: int, total: int) -> None:
        """A rank's loop was left after ``step``, before its ``total`` (a ``break``): an
        injector waiting for a later step learns that it will never come."""

    def close(self) -> None:
        """Stop whatever the hooks started."""
        if self.net is not None:
            self.net.stop()


NO_FAULTS = FaultHooks()


def load(node: int, network: bool = False, environ: dict[str, str] | None = None) -> FaultHooks:
    """The hooks the job's fault injector installs in this process, or :data:`NO_FAULTS`.

    ``network``: this process owns the node's TCP links (the agent), so network faults apply.
    """
    env = os.environ if environ is None else environ
    directory = env.get(ENV)
    if not directory:
        return NO_FAULTS
    found = list(entry_points(group=GROUP))
    if not found:
        log.warning("%s is set but no fault injector is installed; no faults here", ENV)
        return NO_FAULTS
    factory: Any = found[0].load()
    hooks: FaultHooks = factory(directory, node, network)
    return hooks
