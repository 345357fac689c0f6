"""Progress of a long command: a ``rich`` bar on a terminal, plain lines otherwise.

Used by ``inspect --verify`` (chunks checked), ``export`` (tensors written), the chaos
campaign (faults fired) and ``peerckpt run`` while a recovery takes long, such as a cold
start from storage (ranks restored). Plain lines go to the same stream, at most one every
``PLAIN_EVERY_S`` and one at the end, so that a log file or CI output gets a few lines, not
thousands. A ``delay_s`` hides the report of work that ends quickly.

It only reports; it never changes what it reports on. It writes to stderr, never stdout,
which stays the command's output.
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

if TYPE_CHECKING:
    from peerckpt.launch.view import JobView
    from peerckpt.messages.control import JobStatus

PLAIN_EVERY_S = 2.0


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal that can redraw a bar."""
    return stream.isatty() and os.environ.get("TERM", "") != "dumb"


class Report:
    """One task's progress. Use as a context manager; ``update`` or ``advance`` it."""

    def __init__(
        self,
        description: str,
        total: int | None,
        unit: str = "",
        stream: TextIO | None = None,
        delay_s: float = 0.0,
        terminal: bool | None = None,
    ) -> None:
        self.description, self.total, self.unit = description, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = is_terminal(self.stream) if terminal is None else terminal
        self.done = 0
        self._delay_s = delay_s
        self._started = time.monotonic()
        self._last_plain = float("-inf")  # the first update prints at once
        self._shown = False
        self._printed: int | None = None  # the count of the last plain line
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> Report:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def update(self, done: int, total: int | None = None, description: str | None = None) -> None:
        """``done`` of ``total`` (kept when None) units are finished."""
        self.done = done
        self.total = total if total is not None else self.total
        self.description = description or self.description
        now = time.monotonic()
        if not self._shown and now - self._started < self._delay_s:
            return
        self._shown = True
        if self.terminal:
            self._draw()
        elif now - self._last_plain >= PLAIN_EVERY_S:
            self._last_plain = now
            self._line()

    def _draw(self) -> None:
        if self._bar is None:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(self.unit),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
            )
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total)
        assert self._task is not None
        self._bar.update(
            self._task, completed=self.done, total=self.total, description=self.description
        )

    def _line(self) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        unit = f" {self.unit}" if self.unit else ""
        self._printed = self.done
        self.stream.write(f"{self.description}: {self.done}{of}{unit}{pct}\n")
        self.stream.flush()

    def close(self) -> None:
        """End the report: the bar's last state stays on screen; a plain report ends with a
        line saying how far it got."""
        if self._bar is not None:
            assert self._task is not None
            self._bar.update(self._task, completed=self.done, total=self.total)
            self._bar.stop()
            self._bar = None
        elif self._shown and not self.terminal and self._printed != self.done:
            self._line()
            self._shown = False


def callback(report: Report) -> Any:
    """A ``(done, total)`` callback for library functions that report progress."""
    return lambda done, total: report.update(done, total)


class RecoveryProgress:
    """A launcher's watcher: while a recovery lasts longer than ``delay_s`` (a cold start
    from storage, a node lost with much state), report the ranks stepping again."""

    def __init__(self, stream: TextIO | None = None, delay_s: float = 3.0) -> None:
        self._stream = stream
        self._delay_s = delay_s
        self._report: Report | None = None
        self._epoch: int | None = None

    def __call__(self, status: JobStatus, view: JobView) -> None:
        last = view.recoveries[-1] if view.recoveries else None
        if view.recovering and last is not None and last.resumed_at is None:
            if self._report is None or self._epoch != last.epoch:
                self.close()
                step = "nothing committed" if last.restore_step is None else last.restore_step
                self._report = Report(
                    f"recovering from {last.cause} (restoring step {step})",
                    view.world_size,
                    "ranks stepping again",
                    stream=self._stream,
                    delay_s=self._delay_s,
                )
                self._epoch = last.epoch
            self._report.update(len(status.resumed), view.world_size)
        elif self._report is not None:
            self._report.update(view.world_size, view.world_size)
            self.close()

    def close(self) -> None:
        if self._report is not None:
            self._report.close()
            self._report = None
