"""``@resilient``'s options, with their defaults written once.

``ResilientConfig`` is what a training script asks of the runtime; ``resilient()`` builds one
from its keywords (whose defaults are read from here) and the rank runtime reads it. Checked
when it is made: a bad option fails at decoration time, before any process starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from peerckpt.errors import ConfigurationError
from peerckpt.runtime.policy import DEFAULT_MAX_LOST_S, SnapshotPolicy

log = logging.getLogger("peerckpt.policy")


@dataclass(frozen=True)
class ResilientConfig:
    """The options of ``@peerckpt.resilient`` (see its docstring for what each one does)."""

    replicas: int | None = None  # buddies per rank; None: the launcher's, else 1
    erasure: str | None = None  # "K+M": parity over groups instead of replicas (docs/erasure.md)
    persist: str | None = None  # durable URL; None: the launcher's --persist, else none
    persist_every: int | None = None
    persist_interval: float | None = None
    keep: int | None = None
    persist_allow_older: bool = False
    persist_mode: int | None = None
    pg_timeout_s: float = 1800.0
    backend: str | None = None
    suspect_s: float = 30.0
    abort_grace_s: float = 10.0
    abort_timeout_s: float = 30.0
    every: int | None = None  # snapshot after every n-th step; None: n chosen for overhead
    overhead: float = 0.05  # what snapshots may add to the step time, as a fraction of it
    mtbf: float | None = None  # the mean time between failures, seconds (Young/Daly)
    max_lost: float = DEFAULT_MAX_LOST_S  # the most training a failure may lose, seconds
    dedup: bool = True  # mirror no data-parallel replica already held in enough nodes

    def __post_init__(self) -> None:
        if self.persist is None and (
            self.persist_every is not None
            or self.persist_interval is not None
            or self.keep is not None
        ):
            raise ConfigurationError("persist_every, persist_interval and keep need persist=URL")
        if self.replicas is not None and self.replicas < 0:
            raise ConfigurationError(f"replicas must be 0 or more, not {self.replicas}")
        if self.erasure is not None:
            from peerckpt.coding import parse_spec

            try:
                parse_spec(self.erasure)
            except ValueError as exc:
                raise ConfigurationError(str(exc).replace("--erasure ", "erasure=")) from None
            if self.replicas is not None:
                raise ConfigurationError(
                    f"replicas={self.replicas} and erasure={self.erasure!r} both give the job's "
                    "redundancy; choose one"
                )
        for name in ("pg_timeout_s", "suspect_s", "abort_grace_s", "abort_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be positive, not {getattr(self, name)}")
        self.snapshot_policy()  # a bad every/overhead/mtbf fails here too

    def snapshot_policy(self, every: int | None = None) -> SnapshotPolicy:
        """A new rank process's snapshot policy (``runtime/policy.py``), which checks
        ``every``, ``overhead`` and ``mtbf``; ``every``: the launcher's override."""
        if every is not None and every != self.every:
            log.info("snapshot every %d step(s), as the launcher asks", every)
        return SnapshotPolicy(every or self.every, self.overhead, self.mtbf, self.max_lost)

    def persist_msg(self) -> dict[str, Any] | None:
        """The durable tier's settings as the rank announces them to its agent, or None."""
        if self.persist is None:
            return None
        from peerckpt.persist.config import PersistConfig

        return PersistConfig.from_settings(
            self.persist,
            self.persist_every,
            self.persist_interval,
            self.keep,
            self.persist_allow_older,
            self.persist_mode,
        ).to_msg()


DEFAULTS = ResilientConfig()
