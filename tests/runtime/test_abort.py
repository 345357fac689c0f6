"""The rank's way out of an aborted epoch: the watchdog's escalation and the exit it chooses."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from peerckpt.runtime.abort import AbortWatchdog, exit_code
from peerckpt.states import MAX_RESTARTS, ExitCode


class _Rank:
    """What the watchdog watches: a function that unwinds (or not), and what it is told."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.unwound = False
        self.calls: list[str] = []

    def unwind(self) -> None:
        with self.cond:
            self.unwound = True
            self.cond.notify_all()

    def watchdog(self, grace_s: float, timeout_s: float) -> AbortWatchdog:
        return AbortWatchdog(
            self.cond,
            lambda: self.unwound,
            lambda: self.calls.append("cut harder"),
            lambda waited: self.calls.append(f"give up after {waited:g} s"),
            grace_s,
            timeout_s,
        )


def test_a_function_that_unwinds_in_time_is_left_alone() -> None:
    rank = _Rank()
    thread = rank.watchdog(30.0, 30.0).start(epoch=4)
    rank.unwind()  # wakes the watchdog at once: no 30 s wait
    thread.join(5.0)
    assert not thread.is_alive() and rank.calls == []


def test_a_function_stuck_in_a_collective_is_cut_harder_then_given_up() -> None:
    rank = _Rank()
    rank.watchdog(0.05, 0.05).run(epoch=4)  # never unwinds
    assert rank.calls == ["cut harder", "give up after 0.1 s"]


def test_cutting_harder_that_releases_it_ends_the_escalation() -> None:
    rank = _Rank()
    dog = rank.watchdog(0.05, 30.0)
    dog._cut_harder = lambda: (rank.calls.append("cut harder"), rank.unwind())  # type: ignore[method-assign]
    thread = dog.start(epoch=4)
    thread.join(5.0)
    assert not thread.is_alive() and rank.calls == ["cut harder"]


def test_a_stuck_process_restarts_in_place_until_the_limit() -> None:
    announced: list[int] = []

    def announce() -> bool:
        announced.append(1)
        return True

    assert exit_code(0, announce) is ExitCode.RESTART
    assert exit_code(MAX_RESTARTS - 1, announce) is ExitCode.RESTART
    assert exit_code(MAX_RESTARTS, announce) is ExitCode.GAVE_UP
    assert len(announced) == 2  # past the limit the agent is not even asked
    assert exit_code(0, lambda: False) is ExitCode.GAVE_UP  # the agent did not hear it


_ENDED = """
import threading, time
from peerckpt.runtime.abort import exit_if_still_inside
stopped = threading.Event()
exit_if_still_inside(stopped, {wait}, "the job ended (failed) during epoch 1")
if {unwinds}:
    stopped.set()
time.sleep(30)  # a join the abort did not release
"""


def _ended(wait: float, unwinds: bool) -> subprocess.CompletedProcess[str]:
    code = _ENDED.format(wait=wait, unwinds=unwinds)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_rank_still_inside_the_library_after_the_job_ended_exits_with_its_stacks() -> None:
    started = time.monotonic()
    stuck = _ended(0.2, unwinds=False)
    assert stuck.returncode == ExitCode.FAILED and time.monotonic() - started < 20
    assert "the job ended (failed) during epoch 1 0 s ago, and this rank has not" in stuck.stderr
    assert 'File "<string>", line 8' in stuck.stderr  # where it was: the stacks


def test_a_rank_that_unwound_after_the_job_ended_is_left_alone() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(
            [sys.executable, "-c", _ENDED.format(wait=0.2, unwinds=True)], timeout=2, check=False
        )
