"""Where and how often a job writes durable checkpoints: ``PersistConfig``.

Set on the decorator (``@peerckpt.resilient(persist=…)``) or on the launcher (``--persist``);
the coordinator schedules flushes from it (``recovery/flushes.py``), the agents' writers pace
themselves by it (``replication/writer.py``).

The URL may hold credentials (``s3://KEY:SECRET@bucket/…``), so the launcher gives it to the
coordinator in the coordinator's environment (:data:`ENV`, which only the user can read),
never on its command line, which every user of the host sees (``ps``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from peerckpt.errors import ConfigurationError
from peerckpt.persist.localfs import DEFAULT_MODE, check_mode

DEFAULT_EVERY = 100  # steps between flushes when neither steps nor seconds are given
ENV = "PEERCKPT_PERSIST"  # the launcher's --persist (``to_msg`` as JSON), for the coordinator


@dataclass(frozen=True)
class PersistConfig:
    """Where and how often to write durable checkpoints."""

    url: str
    every: int | None = None  # steps
    interval: float | None = None  # seconds
    keep: int | None = None  # committed steps kept (None: all)
    rate: float | None = None  # bytes per second per writer (None: as fast as it goes)
    allow_older: bool = False  # cold start: skip damaged steps (verified first) for older ones
    # Permission bits of the files written to local storage (directories get the matching
    # search bits): 0600/0700 by default, so that other users on the host read nothing.
    mode: int = DEFAULT_MODE

    def __post_init__(self) -> None:
        if self.every is None and self.interval is None:
            raise ValueError("persist needs persist_every (steps) or persist_interval (seconds)")
        if self.every is not None and self.every < 1:
            raise ValueError(f"persist_every must be at least 1, got {self.every}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep must be at least 1, got {self.keep}")
        check_mode(self.mode)
        from peerckpt.persist.location import check_shared  # fsspec: imported when used

        check_shared(self.url)  # StorageUnusable: memory:// is one process's, not the job's

    @classmethod
    def from_settings(
        cls,
        url: str,
        every: int | None,
        interval: float | None,
        keep: int | None,
        allow_older: bool = False,
        mode: int | None = None,
    ) -> PersistConfig:
        """The config a user asked for: every 100 steps unless told steps or seconds.

        Raises ConfigurationError naming a bad setting.
        """
        if every is None and interval is None:
            every = DEFAULT_EVERY
        try:
            return cls(
                url,
                every,
                interval,
                keep,
                allow_older=allow_older,
                mode=DEFAULT_MODE if mode is None else mode,
            )
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None

    def to_msg(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "every": self.every,
            "interval": self.interval,
            "keep": self.keep,
            "rate": self.rate,
            "allow_older": self.allow_older,
            "mode": self.mode,
        }

    @classmethod
    def from_msg(cls, msg: dict[str, Any] | None) -> PersistConfig | None:
        if not msg or not msg.get("url"):
            return None
        return cls(
            msg["url"],
            msg.get("every"),
            msg.get("interval"),
            msg.get("keep"),
            msg.get("rate"),
            bool(msg.get("allow_older")),
            msg.get("mode", DEFAULT_MODE),
        )


def to_env(msg: dict[str, Any] | None) -> dict[str, str]:
    """The variables that give a process the durable settings ``msg`` (``to_msg``): none
    for none."""
    return {ENV: json.dumps(msg)} if msg else {}


def from_env() -> PersistConfig | None:
    """The durable settings :func:`to_env` gave this process, taken out of its environment
    (nothing it starts inherits them)."""
    raw = os.environ.pop(ENV, None)
    return PersistConfig.from_msg(json.loads(raw)) if raw else None
