"""How peerckpt's processes format their log records: for humans (the default), or one JSON
object per line for machines (``--log-format json``, carried to every process of the job as
``PEERCKPT_LOG_FORMAT=json``).

A JSON record holds ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``process`` (launcher,
coordinator, agent node=N, rank), ``message``, the ``rank``, ``epoch`` and ``step`` where a
filter put them on the record, and ``exception`` when one was logged. Ground layer: nothing
here knows a process; callers pass their label and their human format.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone

ENV = "PEERCKPT_LOG_FORMAT"
FORMATS = ("text", "json")
_CONTEXT = ("rank", "epoch", "step")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "process": self.process,
            "pid": record.process,
            "message": record.getMessage(),
        }
        for key in _CONTEXT:
            value = getattr(record, key, None)
            if value is not None and value != "-":
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def log_format() -> str:
    """The format asked for through ``PEERCKPT_LOG_FORMAT`` (``text`` unless ``json``)."""
    return "json" if os.environ.get(ENV, "").strip().lower() == "json" else "text"


def formatter(process: str, human: str) -> logging.Formatter:
    """The formatter for a process labelled ``process``: ``human`` as a logging format
    string, or JSON when ``PEERCKPT_LOG_FORMAT=json``."""
    if log_format() == "json":
        return JsonFormatter(process)
    return logging.Formatter(human)


def configure(process: str, human: str) -> None:
    """Root logging on stderr at ``PEERCKPT_LOG_LEVEL`` with :func:`formatter`."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(process, human))
    logging.basicConfig(level=os.environ.get("PEERCKPT_LOG_LEVEL", "INFO"), handlers=[handler])
