"""What a rank process died of, left for its launcher to say.

A script that fails at its top level, before its ranks connect (an import that is missing, a
data file not found, a collective there: ``runtime/usercoll.py``), ended the job with
``rank 0 (exit status 1), rank 1 (exit status 1) … exited before the job started; see the
script's output above``, the exception itself scrolled away among four tracebacks. In a job's
training process (``runtime/standby.py``, at ``import peerckpt``) ``install`` chains a
``sys.excepthook`` that also writes the exception's last line to ``exit-<pid>.txt`` in the
launcher's run directory (the directory of the agent's socket, private to the job's user),
and the launcher names it with the exit status (``read``). The traceback is printed as
before.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from types import TracebackType

LIMIT = 600  # characters of the exception's line kept


def _path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"exit-{pid}.txt")


def install(directory: str) -> None:
    """Chain a ``sys.excepthook`` that leaves the uncaught exception's line in ``directory``."""
    if not os.path.isdir(directory):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            with contextlib.suppress(Exception):  # the traceback is printed whatever happens
                lines = traceback.format_exception_only(kind, value)
                words = (ln.strip() for part in lines for ln in part.splitlines())
                line = " ".join(w for w in words if w)[:LIMIT]
                path = _path(directory, os.getpid())
                with open(path + ".tmp", "w", encoding="utf-8", errors="replace") as f:
                    f.write(line)
                os.replace(path + ".tmp", path)
        previous(kind, value, tb)

    sys.excepthook = hook


def read(directory: str, pid: int) -> str | None:
    """The line process ``pid`` left in ``directory``, if it left one."""
    try:
        with open(_path(directory, pid), encoding="utf-8", errors="replace") as f:
            return f.read(LIMIT).strip() or None
    except OSError:
        return None
