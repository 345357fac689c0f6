"""What a launcher tells a rank process, through its environment.

``peerckpt run`` sets, for every rank and spare process it starts::

    PEERCKPT_JOB, PEERCKPT_SECRET (hex), PEERCKPT_AGENT (the node agent's Unix socket),
    PEERCKPT_NODE, PEERCKPT_ROLE ("rank" or "spare"), and torchrun's RANK, LOCAL_RANK,
    WORLD_SIZE for the first epoch.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from peerckpt import logs
from peerckpt.errors import ConfigurationError
from peerckpt.secret import ENV as SECRET_ENV
from peerckpt.secret import NAMES as SECRET_NAMES
from peerckpt.secret import secret_from_env
from peerckpt.states import ProcRole


@dataclass(frozen=True)
class LaunchEnv:
    job: str
    secret: bytes
    agent_socket: str
    node: int
    role: ProcRole
    rank: int | None
    world_size: int | None
    # Who restarts this process after a failure ("torchrun"), or "" (peerckpt recovers it
    # in place). Set by ``runtime/torchrun.py``.
    restart_based: str = ""
    # ``PEERCKPT_SNAPSHOT_EVERY``: the launcher's override of the snapshot interval (the
    # reference run of ``peerckpt chaos`` snapshots every step, to compare any step with).
    snapshot_every: int | None = None

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> LaunchEnv:
        env = os.environ if environ is None else environ
        missing = [k for k in ("PEERCKPT_JOB", "PEERCKPT_AGENT") if k not in env]
        if not any(name in env for name in SECRET_NAMES):
            missing.insert(1, SECRET_ENV)
        if missing:
            raise ConfigurationError(
                f"this process was not started by a peerckpt launcher ({', '.join(missing)} "
                "unset). A function decorated with @peerckpt.resilient runs inside a job: start "
                "the script with `peerckpt run --nodes N --nproc-per-node P script.py` (or with torchrun)."
            )
        try:
            role = ProcRole(env.get("PEERCKPT_ROLE", "rank"))
        except ValueError:
            raise ConfigurationError(
                f"PEERCKPT_ROLE must be 'rank', 'spare' or 'joiner', not "
                f"{env.get('PEERCKPT_ROLE')!r}"
            ) from None
        secret = secret_from_env(env)
        if environ is None:
            # Read once, then out of this process's environment: the user's script, its
            # subprocesses and its DataLoader workers inherit what stays there, and a
            # tool that dumps the environment would print the job's key with it.
            os.environ.pop(SECRET_ENV, None)
        return cls(
            job=env["PEERCKPT_JOB"],
            secret=secret,
            agent_socket=env["PEERCKPT_AGENT"],
            node=int(env.get("PEERCKPT_NODE", "0")),
            role=role,
            rank=int(env["RANK"]) if role is ProcRole.RANK and "RANK" in env else None,
            world_size=int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env else None,
            restart_based=env.get("PEERCKPT_RESTART_BASED", ""),
            snapshot_every=_positive(env, "PEERCKPT_SNAPSHOT_EVERY"),
        )


def _positive(env: Mapping[str, str], name: str) -> int | None:
    """An optional positive integer setting, or a ConfigurationError naming it."""
    value = env.get(name)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigurationError(f"{name} must be a whole number of steps ≥ 1, not {value!r}")
    return int(value)


class RankFilter(logging.Filter):
    """Adds ``rank``, ``epoch`` and ``step`` of this process to every log record."""

    runtime: ClassVar[Any] = None

    def filter(self, record: logging.LogRecord) -> bool:
        rt = RankFilter.runtime
        a = getattr(rt, "assignment", None)
        record.rank = a.rank if a is not None else "-"
        record.epoch = a.epoch if a is not None else "-"
        step = getattr(rt, "step", None)
        record.step = step if step is not None else "-"
        return True


def configure_logging(level: str | None = None) -> None:
    """Give peerckpt's records rank, epoch and step; keep the user's handlers alone."""
    logger = logging.getLogger("peerckpt")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RankFilter())
    handler.setFormatter(
        logs.formatter(
            "rank",
            "%(asctime)s peerckpt[rank=%(rank)s epoch=%(epoch)s step=%(step)s] "
            "%(levelname)s %(message)s",
        )
    )
    logger.addHandler(handler)
    logger.setLevel(level or os.environ.get("PEERCKPT_LOG_LEVEL", "INFO"))
    logger.propagate = False
