"""Leaving an aborted epoch, for sure: the watchdog that escalates when a rank does not.

An abort cuts the process group's connections, which releases every blocked collective we
have seen but one: under heavy load, FSDP2's gloo reduce-scatter stayed blocked once in about
twenty runs. So ``AbortWatchdog`` escalates while the function has not unwound: after
``grace_s`` it cuts harder (every connection the process opened to the job's hosts since the
epoch began), and after ``timeout_s`` more it gives up on the process. A healthy node with
the state in its agent's memory can take a fresh process instead: the process announces a
restart in place and exits ``ExitCode.RESTART`` (``exit_code``), unless it has restarted
``MAX_RESTARTS`` times in a row, or the agent did not hear it, and then it exits as a lost
rank (``ExitCode.GAVE_UP``).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
from collections.abc import Callable

from peerckpt.states import MAX_RESTARTS, ExitCode

log = logging.getLogger("peerckpt.rank")


def exit_code(restarts: int, announce: Callable[[], bool]) -> ExitCode:
    """How a process that cannot leave an aborted epoch ends: ``RESTART`` if it may restart
    again and ``announce()`` (telling its agent) succeeded, else ``GAVE_UP``."""
    if restarts < MAX_RESTARTS and announce():
        return ExitCode.RESTART
    return ExitCode.GAVE_UP


class AbortWatchdog:
    """Escalates until ``unwound()`` is true: ``cut_harder()`` after ``grace_s``, then
    ``give_up(waited_s)`` after ``timeout_s`` more. ``cond`` is notified when the function
    unwinds (the rank runtime's condition)."""

    def __init__(
        self,
        cond: threading.Condition,
        unwound: Callable[[], bool],
        cut_harder: Callable[[], None],
        give_up: Callable[[float], None],
        grace_s: float,
        timeout_s: float,
    ) -> None:
        self._cond = cond
        self._unwound = unwound
        self._cut_harder = cut_harder
        self._give_up = give_up
        self.grace_s = grace_s
        self.timeout_s = timeout_s

    def start(self, epoch: int) -> threading.Thread:
        thread = threading.Thread(
            target=self.run, args=(epoch,), name="peerckpt-abort-watchdog", daemon=True
        )
        thread.start()
        return thread

    def run(self, epoch: int) -> None:
        for wait_s, final in ((self.grace_s, False), (self.timeout_s, True)):
            with self._cond:
                if self._cond.wait_for(self._unwound, timeout=wait_s):
                    return
            # Where every thread is: what the collective that did not return was waiting on.
            faulthandler.dump_traceback(all_threads=True)
            if not final:
                log.warning(
                    "still inside aborted epoch %d after %.0f s (the threads' stacks are above); "
                    "cutting harder",
                    epoch,
                    wait_s,
                )
                self._cut_harder()
            else:
                self._give_up(self.grace_s + wait_s)


def exit_if_still_inside(stopped: threading.Event, wait_s: float, why: str) -> threading.Thread:
    """Ends the process if ``stopped`` is not set within ``wait_s`` of ``why`` (the job ended,
    failed or stopped). A rank still inside a join or a restore that the abort did not release
    (seen: a spare joining a group whose other members had just died, gloo connecting to them
    until its timeout) would otherwise stay until its launcher kills it, 20 s on, with nothing
    said about where it was. The user's own cleanup (``finally``) gets ``wait_s`` too."""

    def run() -> None:
        if stopped.wait(wait_s):
            return
        faulthandler.dump_traceback(all_threads=True)
        log.error(
            "%s %.0f s ago, and this rank has not finished (the threads' stacks are above); "
            "it exits",
            why,
            wait_s,
        )
        logging.shutdown()
        os._exit(ExitCode.FAILED)

    thread = threading.Thread(target=run, name="peerckpt-end-watchdog", daemon=True)
    thread.start()
    return thread
