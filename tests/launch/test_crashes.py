"""The launcher names a rank process's crash (the signal its own code raised) and, when the
same rank crashes the same way after each restore, says so with the job's failure."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from peerckpt.launch.crashes import Crashes, OomKills, _cgroup_oom_files, crash_of

SEGFAULT = "import ctypes; ctypes.string_at(0)"
KILLED = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"


def _ended(code: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    proc.wait(timeout=60)
    return proc


def test_a_crash_is_told_from_an_exit_and_a_kill_from_outside() -> None:
    assert crash_of(_ended(SEGFAULT).returncode) == "SIGSEGV (segmentation fault)"
    assert crash_of(_ended(KILLED).returncode) is None  # chaos, the OOM killer: not its own
    assert crash_of(_ended("raise SystemExit(3)").returncode) is None
    assert crash_of(None) is None


def test_each_crash_is_logged_once_under_the_rank_the_process_held(caplog) -> None:
    crashes = Crashes()
    first, second = _ended(SEGFAULT), _ended(SEGFAULT)
    with caplog.at_level(logging.WARNING, logger="peerckpt.launcher"):
        crashes.observe({1: (0, first.pid)}, [(0, first)])
        crashes.observe({1: (0, first.pid)}, [(0, first)])  # seen already: said once
        # The restarted process took rank 1 and crashed too; the status names it now.
        crashes.observe({1: (0, second.pid)}, [(0, first), (0, second)])
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"rank 1 (pid {p.pid}) on node 0 crashed: killed by SIGSEGV (segmentation fault); its "
        "Python stack, if it had one, is above"
        for p in (first, second)
    ]
    assert crashes.recurring().startswith(
        "rank 1 crashed 2 times, each by SIGSEGV (segmentation fault): a crash that recurs "
        "after every restore comes from the job's code"
    )


@pytest.mark.parametrize(
    ("codes", "recurs"),
    [
        ([SEGFAULT], False),  # once: a machine may have failed
        ([SEGFAULT, KILLED], False),  # then killed from outside: not the same way
        ([KILLED, KILLED], False),  # killed twice (chaos): not a crash
        ([SEGFAULT, SEGFAULT, SEGFAULT], True),
    ],
)
def test_only_the_same_crash_every_time_is_called_recurring(codes, recurs) -> None:
    crashes = Crashes(OomKills([]))  # no OOM count to read: a SIGKILL is a kill
    for code in codes:
        proc = _ended(code)
        crashes.observe({2: (1, proc.pid)}, [(1, proc)])
    assert bool(crashes.recurring()) is recurs


def test_a_process_that_held_no_rank_is_not_counted() -> None:
    crashes = Crashes()
    spare = _ended(SEGFAULT)
    crashes.observe({0: (0, 1)}, [(1, spare)])  # a spare that never took a rank
    assert crashes.by_rank == {}


def _counts(path, vmstat: int) -> None:
    path.write_text(f"pgfault 12\noom_kill {vmstat}\nnr_free_pages 3\n")


def test_a_rank_killed_while_the_kernels_oom_count_grew_is_named_killed_for_memory(
    tmp_path, caplog
) -> None:
    vmstat = tmp_path / "vmstat"
    _counts(vmstat, 7)
    crashes = Crashes(OomKills([str(vmstat)]))
    chaos = _ended(KILLED)
    crashes.observe({2: (0, chaos.pid)}, [(0, chaos)])  # a kill, no OOM: not a crash
    assert crashes.by_rank == {2: [None]}
    with caplog.at_level(logging.WARNING, logger="peerckpt.launcher"):
        for count in (8, 9):  # the restarted process is killed for memory again
            _counts(vmstat, count)
            proc = _ended(KILLED)
            crashes.observe({1: (0, proc.pid)}, [(0, proc)])
    said = caplog.records[-1].getMessage()
    assert said == (
        f"rank 1 (pid {proc.pid}) on node 0 crashed: killed by SIGKILL (out of memory): the "
        f"kernel's OOM killer (oom_kill in {vmstat} 8 → 9)"
    )
    assert crashes.recurring().startswith(
        "rank 1 crashed 2 times, each by SIGKILL (out of memory): the machine runs out of "
        "memory after every restore"
    )


def test_the_oom_counts_are_found_in_cgroup_v1_and_v2(tmp_path) -> None:
    (tmp_path / "job.slice").mkdir()
    (tmp_path / "job.slice" / "memory.events").write_text("low 0\noom 2\noom_kill 1\n")
    (tmp_path / "memory" / "docker" / "abc").mkdir(parents=True)
    (tmp_path / "memory" / "docker" / "abc" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n"
    )
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.write_text("0::/job.slice\n")
    v1.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    [events] = _cgroup_oom_files(str(v2), str(tmp_path))
    [control] = _cgroup_oom_files(str(v1), str(tmp_path))  # the namespace root has none here
    oom = OomKills([events, control])
    assert oom.grew() == ""
    (tmp_path / "job.slice" / "memory.events").write_text("low 0\noom 3\noom_kill 2\n")
    assert oom.grew() == f"oom_kill in {events} 1 → 2"
    assert oom.grew() == ""  # said once


def test_an_oom_kill_of_polls_ago_does_not_name_a_later_sigkill(tmp_path) -> None:
    # The count grew (a DataLoader worker killed for memory, another job's process): a rank
    # SIGKILLed polls later by chaos or fencing is not said to have run out of memory.
    vmstat = tmp_path / "vmstat"
    _counts(vmstat, 1)
    crashes = Crashes(OomKills([str(vmstat)]))
    _counts(vmstat, 2)
    for _ in range(3):
        crashes.observe({}, [])  # the launcher's status polls
    proc = _ended(KILLED)
    crashes.observe({1: (0, proc.pid)}, [(0, proc)])
    assert crashes.by_rank == {1: [None]}
