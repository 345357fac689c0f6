"""Named states of peerckpt's processes and jobs, each with the one table of its changes.

Every enum whose value changes over time has a transition table here and a ``check`` that
raises on a change the table does not allow, in the style of the rank's own state machine
(``runtime/state.py``). Processes store these enums, never strings; messages carry their
values.
"""

from __future__ import annotations

import enum

MAX_RESTARTS = 3  # in-place restarts in a row for one rank's line of processes


class ExitCode(enum.IntEnum):
    """How a peerckpt process ends. A launcher reads them; a test may, too."""

    OK = 0
    FAILED = 1  # the job failed (the launcher), or the user's function raised (a rank)
    NODE_LOST = 70  # a rank whose node agent is gone: its node is lost with it
    LAUNCHER_GONE = 71  # a process whose launcher is gone
    GAVE_UP = 74  # a rank that could not leave an aborted epoch; the job goes on without it
    RESTART = 75  # the same, but a fresh process on its node takes its place
    INTERRUPTED = 130  # stopped by a signal (Ctrl-C)
