"""What every peerckpt service process (agent, coordinator) does first and last: logging,
the job's secret from its environment, and an orderly stop on SIGTERM or SIGINT."""

from __future__ import annotations

import signal
from collections.abc import Callable

from peerckpt import logs
from peerckpt.secret import secret_from_env


def service_process(label: str) -> bytes:
    """Start a peerckpt service process (agent, coordinator): logging labelled ``label`` on
    stderr, at ``PEERCKPT_LOG_LEVEL``, as text or JSON (``peerckpt/logs.py``); return the
    job's secret from ``PEERCKPT_SECRET``."""
    logs.configure(label, f"%(asctime)s peerckpt[{label}] %(levelname)s %(message)s")
    return secret_from_env()


def stop_on_signals(stop: Callable[[], None]) -> None:
    """Make SIGTERM and SIGINT call ``stop`` (the process then shuts down in order)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop())
