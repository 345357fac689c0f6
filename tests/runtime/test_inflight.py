"""What ends a collective's wait at an abort: ``InFlight``, and DDP's all-reduce routed through
it (``runtime/inflight.py``), against a send gloo never ends when its connection closes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from peerckpt.runtime.inflight import InFlight
from tests.conftest import REPO


def _issue(in_flight: InFlight) -> tuple[torch.futures.Future[Any], torch.futures.Future[Any]]:
    """A collective that ends when the test says (its future) and what its waiter waits on."""
    work: torch.futures.Future[Any] = torch.futures.Future()
    return work, in_flight.issue(lambda: work, lambda value: value[0])


def test_a_watched_collective_completes_its_waiter_with_its_own_result() -> None:
    in_flight = InFlight()
    work, waited = _issue(in_flight)
    assert in_flight.open() == 1 and not waited.done()
    work.set_result([torch.ones(2)])
    assert torch.equal(waited.wait(), torch.ones(2)) and in_flight.open() == 0
    assert in_flight.release("epoch 3 was aborted") == 0  # nothing left to release


def test_an_abort_fails_the_waiter_of_a_collective_that_never_ends() -> None:
    in_flight = InFlight()
    work, waited = _issue(in_flight)
    told: list[list[torch.futures.Future[Any]]] = []

    def unfinished(works: list[torch.futures.Future[Any]]) -> None:
        told.append(works)
        assert not waited.done()  # told before the waiter wakes (and leaves the epoch)

    assert in_flight.release("epoch 3 was aborted", unfinished) == 1
    assert told == [[work]]  # still inside gloo
    # Raised in ``then``, the error reaches a waiter in C++ (DDP's reducer) as an error too.
    with pytest.raises(RuntimeError, match="MembershipChanged: epoch 3 was aborted"):
        waited.wait()
    work.set_result([torch.ones(2)])  # ends later (gloo's timeout): nobody is told twice
    assert in_flight.open() == 0


def test_after_an_abort_no_collective_starts_until_the_next_epoch() -> None:
    in_flight = InFlight()
    in_flight.release("epoch 3 was aborted")
    started: list[torch.futures.Future[Any]] = []

    def start() -> torch.futures.Future[Any]:
        started.append(torch.futures.Future())
        return started[-1]

    late = in_flight.issue(start, lambda v: v)
    assert started == [] and in_flight.open() == 0
    with pytest.raises(RuntimeError, match="MembershipChanged: epoch 3 was aborted"):
        late.wait()
    in_flight.reopen()
    work, waited = _issue(in_flight)
    work.set_result([7])
    assert waited.wait() == 7


def test_a_collective_that_fails_fails_its_waiter_with_its_error() -> None:
    in_flight = InFlight()
    work, waited = _issue(in_flight)
    work.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        waited.wait()
    assert in_flight.release("epoch 3 was aborted") == 0


@contextlib.contextmanager
def three_ranks(
    module: str, *args: str, env: dict[str, str] | None = None
) -> Iterator[list[subprocess.Popen[str]]]:
    """The three ranks of ``python -m module RANK STORE_ADDR *args`` on a store hosted here;
    every one is killed on the way out (a rank may stop itself, another wait for it)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{store.port}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, str(r), addr, *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(3)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.communicate()


def _three_ranks(
    mode: str, pg_timeout_s: float
) -> contextlib.AbstractContextManager[list[subprocess.Popen[str]]]:
    """The three ranks of ``tests/runtime/ddp_gloo.py`` (rank 2 stops itself, rank 1 waits
    for it forever)."""
    return three_ranks("tests.runtime.ddp_gloo", mode, str(pg_timeout_s))


def _result(proc: subprocess.Popen[str], wait_s: float) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()  # with its threads' stacks (the script dumps them at 60 s)
        pytest.fail(f"the rank did not end within {wait_s:.0f} s:\n{out[-6000:]}")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, out[-3000:]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# The thread that completes a collective (gloo's; here a daemon thread) runs its callback on;
# the waiter, woken, exits the script while that thread is still inside (``slow``: as a
# thread the scheduler has not run again yet). The callback leaves a mark when it returns.
_EXIT_WHILE_A_CALLBACK_RUNS = """
import sys, threading, time, torch
from peerckpt.runtime.inflight import IN_FLIGHT

work = torch.futures.Future()
woken = threading.Event()
def slow(outcome):
    woken.set()
    time.sleep(1.5)
    open(sys.argv[1], "w").close()
    return outcome.value()
waited = IN_FLIGHT.issue(lambda: work, lambda value: value).then(slow)  # as DDP's reducer
threading.Thread(target=lambda: work.set_result(1), daemon=True).start()
woken.wait(30)
"""


def test_a_script_exits_only_once_a_collectives_callback_has_returned(tmp_path) -> None:
    """Seen in CI: a rank killed by SIGABRT ("terminate called without an active exception")
    as its script exited after training: the callback's thread took the GIL back once the
    interpreter was finalizing (reproduced by hand in this script, with an object whose
    ``__del__`` makes the finalization last: 2 runs of 3 aborted). The exit now waits for
    the callback (``InFlight.quiesce`` at exit): without it, the mark is never made."""
    mark = tmp_path / "callback-returned"
    _assert_exits_leaving(_EXIT_WHILE_A_CALLBACK_RUNS, mark)


def _run_script(script: str, argument: str, timeout: float) -> str:
    """Run ``script`` in a fresh interpreter from the repository; it exits 0. Its output."""
    result = subprocess.run(
        [sys.executable, "-c", script, argument],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def _assert_exits_leaving(script: str, mark: Any) -> None:
    """Run ``script`` (its argument: ``mark``'s path); it exits 0 having made ``mark``."""
    _run_script(script, str(mark), timeout=120)
    assert mark.exists()


class _HeldCallback:
    """A collective's work whose completing thread, like one of gloo's, runs the callback and
    lets go of it only later: torch's guard of a Python callback takes the GIL again after the
    callback has returned, to drop its reference (a thread that takes the GIL once the
    interpreter finalizes aborts the process)."""

    def __init__(self, hold_s: float, mark: str | None = None) -> None:
        self.hold_s, self.mark = hold_s, mark
        self.finished = threading.Event()
        self._callbacks: list[Any] = []
        self._done = False

    def add_done_callback(self, callback: Any) -> None:
        self._callbacks.append(callback)

    def done(self) -> bool:
        return self._done

    def value(self) -> Any:
        return [torch.ones(1)]

    def complete(self) -> None:
        def run() -> None:
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                callback(self)
            time.sleep(self.hold_s)  # the callback has returned; its guard still holds it
            callbacks.clear()
            if self.mark:
                open(self.mark, "w").close()
            self.finished.set()

        threading.Thread(target=run, daemon=True).start()


def test_quiesce_waits_until_the_callbacks_thread_has_let_go_of_it() -> None:
    in_flight = InFlight()
    work = _HeldCallback(hold_s=0.5)
    waited = in_flight.issue(lambda: work, lambda value: value[0])  # type: ignore[arg-type,return-value]
    work.complete()
    assert torch.equal(waited.wait(), torch.ones(1))  # the waiter is released at once
    assert not in_flight.quiesce(0.1)  # but the thread still holds the callback
    assert in_flight.quiesce(30.0)
    assert work.finished.is_set()


_EXIT_WHILE_A_THREAD_HOLDS_THE_CALLBACK = """
import sys, time, torch
sys.path.insert(0, ".")
from peerckpt.runtime.inflight import IN_FLIGHT
from tests.runtime.test_inflight import _HeldCallback

work = _HeldCallback(hold_s=1.0, mark=sys.argv[1])
waited = IN_FLIGHT.issue(lambda: work, lambda value: value[0])
work.complete()
waited.wait()
"""


def test_a_script_exits_only_once_the_callbacks_thread_has_let_go_of_it(tmp_path) -> None:
    """The window CI hit once after the last fix (SIGABRT as a script exited): the callback
    had returned, so the exit went on, while its thread had still to take the GIL back to
    let go of it. Without the wait, the thread never finishes (no mark)."""
    mark = tmp_path / "let-go"
    _assert_exits_leaving(_EXIT_WHILE_A_THREAD_HOLDS_THE_CALLBACK, mark)


def test_quiesce_waits_for_a_running_callback_not_for_a_collective_stuck_in_gloo() -> None:
    in_flight = InFlight()
    _issue(in_flight)  # never completes, as a send gloo never ends: not waited for
    assert in_flight.quiesce(0.0)
    work, waited = _issue(in_flight)
    inside, leave = threading.Event(), threading.Event()

    def blocked(outcome: torch.futures.Future[Any]) -> Any:
        inside.set()
        leave.wait(30)
        return outcome.value()

    chained = waited.then(blocked)
    completer = threading.Thread(target=lambda: work.set_result([torch.ones(1)]), daemon=True)
    completer.start()
    assert inside.wait(30)
    assert not in_flight.quiesce(0.2)  # its callback is still running
    leave.set()
    assert in_flight.quiesce(30.0)
    assert torch.equal(chained.wait(), torch.ones(1))
    completer.join(30)


_THREAD_STATES = """
import ctypes, json, os, sys, threading, time
import torch, torch.distributed as dist
sys.path.insert(0, ".")
from peerckpt.runtime.inflight import InFlight, outcome_of

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
in_flight = InFlight()
state_id = ctypes.PYFUNCTYPE(ctypes.c_uint64)(("PyThreadState_Get", ctypes.pythonapi))
get_id = ctypes.PYFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64)(("PyThreadState_GetID", ctypes.pythonapi))


def all_reduce():
    tensor = torch.ones(4)  # let go at once: its last reference is gloo's
    start = lambda: dist.all_reduce(tensor, async_op=True).get_future()
    outcome_of(in_flight.watch(start, lambda value: None))


def made():  # how many Python thread states this process has made: a new one's id
    ids = []
    probe = threading.Thread(target=lambda: ids.append(get_id(state_id())))
    probe.start(); probe.join()
    return ids[0]


for _ in range(20):  # each of gloo's threads runs a callback at least once
    all_reduce()
before = made()
for _ in range(100):
    all_reduce()
result = {"made": made() - before - 1}  # less the second probe's own
forks = int(sys.argv[1])
if forks:  # fork while collectives' callbacks run: a child that hangs in os.fork() never exits
    done = threading.Event()
    def churn():
        while not done.is_set():
            all_reduce()
    churner = threading.Thread(target=churn)
    churner.start()
    hung = 0
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG)[0] == 0:
            time.sleep(0.001)
        if time.monotonic() >= deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    done.set()
    churner.join()
    result["hung"] = hung
print(json.dumps(result))
"""


def _thread_states(forks: int) -> dict[str, int]:
    out = _run_script(_THREAD_STATES, str(forks), timeout=280)
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_callbacks_thread_makes_no_python_thread_state_after_its_first_callback() -> None:
    """Seen: a rank hung, and its job, inside a DataLoader worker's ``os.fork()`` (1 run in 15
    to 20 of an imagenet script): gdb showed the child waiting for the interpreter's
    thread-state lock, held at the fork by gloo's thread making a Python thread state to run
    a collective's callback. pybind11 made three per collective (300 per 100 before the
    fix); the thread's state is now kept (``_keep_thread_state``): one at most per thread."""
    # At most one per gloo worker thread (2) that ran no callback during the warm-up.
    assert _thread_states(forks=0)["made"] <= 2


@pytest.mark.slow  # 2000 forks of a torch process: about 30 s
def test_forks_beside_collectives_callbacks_never_hang() -> None:
    """The hang itself, as a stress: a thread runs watched collectives while the main thread
    forks 2000 times. Before the fix, 8 of 2000 children hung inside ``os.fork()``."""
    result = _thread_states(forks=2000)
    assert result["hung"] == 0, result


def test_an_abort_releases_a_ddp_backward_whose_send_gloo_never_ends() -> None:
    """Rank 0's all-reduce waits for a send to a peer that stopped reading when its abort cuts
    the connections. Before the fix, its backward stayed until the group's timeout (here
    120 s) and ended with gloo's 'Timed out waiting ... for send operation'; now it raises at
    the abort, the group is kept for its worker still inside gloo, and the process exits
    without joining that worker (the interpreter's exit would wait for it otherwise)."""
    with _three_ranks("stuck-hook", pg_timeout_s=120.0) as (rank0, _, _):
        result = _result(rank0, wait_s=90.0)  # an exit joining the stuck worker takes 120 s
    assert result["backward"].startswith("RuntimeError"), result
    assert "MembershipChanged: epoch 0 was aborted" in result["backward"], result
    assert result["kept"] == 1, result


def test_an_abort_releases_a_ddp_buffer_broadcast_whose_send_gloo_never_ends() -> None:
    """Rank 0's DDP forward broadcasts its BatchNorm buffers behind a send to a peer that
    stopped reading; its abort (3 s in) then cuts the connections. Before the fix the forward
    (DDP's ``_broadcast_coalesced``, waiting in C++ on gloo's own work) stayed until the
    group's timeout (here 120 s, so the test fails at its 60 s bound, which leaves three ranks
    time to start on a loaded machine: 27 s seen); now it raises ``MembershipChanged`` at the
    abort, and the abort counts the broadcast (kept: it knew it was still inside gloo)."""
    with _three_ranks("broadcast-hook", pg_timeout_s=120.0) as (rank0, _, _):
        result = _result(rank0, wait_s=60.0)
    assert result["forward"] == "MembershipChanged: epoch 0 was aborted", result
    assert result["seconds"] < 3.0 + 2.0, result
    assert result["kept"] == 1, result  # the broadcast is still inside gloo


def test_an_abort_releases_the_scripts_own_all_reduce_whose_send_gloo_never_ends() -> None:
    """The distributed tutorial's ``dist.all_reduce`` of a gradient, behind a send to a peer
    that stopped reading; the abort (3 s in) cuts the connections. torch's own call stays
    until the group's timeout (a job's rank: 40 s, until the watchdog restarted it in place);
    the one a job's process finds raises ``MembershipChanged`` at the abort."""
    with _three_ranks("user-hook", pg_timeout_s=120.0) as (rank0, _, _):
        result = _result(rank0, wait_s=60.0)
    assert result["all_reduce"] == "MembershipChanged: epoch 0 was aborted", result
    assert result["seconds"] < 3.0 + 2.0, result
    assert result["kept"] == 1, result  # the all-reduce is still inside gloo


@pytest.mark.slow  # waits out a 10 s process-group timeout, three times
@pytest.mark.parametrize(
    ("mode", "waiter"),
    [("stuck-plain", "backward"), ("broadcast-plain", "forward"), ("user-plain", "all_reduce")],
)
def test_gloo_still_never_ends_a_queued_send_when_its_connection_closes(
    mode: str, waiter: str
) -> None:
    """Why ``release_on_abort`` exists: without it, the same backward (the gradient
    all-reduce) or forward (the buffer broadcast) ends only with gloo's own timeout. If this
    fails, gloo ends such sends now; the hook and the broadcast can then go."""
    with _three_ranks(mode, pg_timeout_s=10.0) as (rank0, _, _):
        result = _result(rank0, wait_s=90.0)
    assert "Timed out waiting 10000ms for send operation" in result[waiter], result
    assert result["kept"] == 0, result  # no watched collective: nothing known to keep


def test_the_hook_and_the_broadcast_give_the_same_bits_as_ddps_own() -> None:
    """Three ranks (1/3 is not exact in binary): three steps, initial and rebuilt buckets; the
    BatchNorm buffers broadcast at each forward, in more buckets than two in flight."""
    digests = {}
    for mode in ("bits-plain", "bits-hook"):
        with _three_ranks(mode, pg_timeout_s=60.0) as procs:
            digests[mode] = [_result(proc, wait_s=120.0) for proc in procs]
    assert [r["digest"] for r in digests["bits-hook"]] == [
        r["digest"] for r in digests["bits-plain"]
    ]
    assert [r["buffers"] for r in digests["bits-hook"]] == [
        r["buffers"] for r in digests["bits-plain"]
    ]
    for key in ("digest", "buffers"):  # every rank holds the same gradients, and rank 0's buffers
        assert len({r[key] for r in digests["bits-plain"]}) == 1
