"""The prefork server: spares forked after torch is imported once, each what ``python script``
would be, refused without the secret, and nothing left behind when the server or its launcher
dies."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from peerckpt.errors import AuthenticationError
from peerckpt.launch.prefork import Forked
from peerckpt.launch.processes import Node, ProcessSet
from peerckpt.states import ProcRole
from peerckpt.wire import Connection, client_handshake
from tests.conftest import job_name

JOB = job_name()  # the leak check finds whatever these tests leave running
# Records what a script sees of its interpreter, then exits with the status it is given.
SCRIPT = """
import atexit, json, os, random, sys, threading, time
import numpy
out = sys.argv[1]
def record(**what):
    with open(out, "a") as f:
        f.write(json.dumps(what) + "\\n")
record(argv=sys.argv, cwd=os.getcwd(), path0=sys.path[0], name=__name__, file=__file__,
       role=os.environ.get("PEERCKPT_ROLE"), x=os.environ.get("X"),
       leaked=os.environ.get("SERVER_ONLY"), random=random.random(),
       numpy=float(numpy.random.random()), pid=os.getpid(), ppid=os.getppid(),
       pgid=os.getpgid(0), sid=os.getsid(0), torch="torch" in sys.modules,
       cmdline=open("/proc/self/cmdline", "rb").read().decode().replace("\\0", " "))
atexit.register(lambda: record(at="exit"))
def late():
    time.sleep(0.3)
    record(at="thread")
threading.Thread(target=late).start()
how = sys.argv[2]
if how == "raise":
    raise RuntimeError("the script failed")
if how == "wait":
    while not os.path.exists(out + ".go"):
        time.sleep(0.02)
    how = "0"
sys.exit(int(how))
"""


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessSet]:
    made: list[ProcessSet] = []

    def make(*args: str, prefork: bool = True) -> ProcessSet:
        script = tmp_path / "script.py"
        script.write_text(SCRIPT)
        env = {"PEERCKPT_PREFORK": "1" if prefork else "0"}
        rundir = tmp_path / f"run{len(made)}"
        rundir.mkdir(mode=0o700)
        ps = ProcessSet(JOB, secrets.token_bytes(32), [str(script), *args], str(rundir), env)
        ps.nodes[0] = Node(0, subprocess.Popen([sys.executable, "-c", "pass"]), "agent.sock")
        made.append(ps)
        return ps

    yield make  # type: ignore[misc]
    for ps in made:
        for node in ps.nodes.values():
            for proc in [node.agent, *node.procs]:
                if proc.poll() is None:
                    proc.kill()
        ps.stop()


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_forked_spare_is_what_python_script_would_be(procs, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    ps = procs(str(out), "3")
    os.environ["SERVER_ONLY"] = "1"  # in the server's environment, not in the request's
    try:
        ps.start_prefork()
    finally:
        del os.environ["SERVER_ONLY"]
    first = ps.start_proc(0, ProcRole.SPARE, X="one")
    assert isinstance(first, Forked)
    assert first.wait(timeout=60) == 3
    second = ps.start_proc(0, ProcRole.SPARE, X="two")
    assert second.wait(timeout=60) == 3
    assert ps.prefork is not None
    server = ps.prefork.proc.pid
    records = _records(out)
    starts = [r for r in records if "argv" in r]
    assert len(starts) == 2
    script = str(tmp_path / "script.py")
    for rec, x in zip(starts, ("one", "two"), strict=True):
        assert rec["argv"] == [script, str(out), "3"]
        assert rec["cwd"] == os.getcwd() and rec["path0"] == str(tmp_path)
        assert rec["name"] == "__main__" and rec["file"] == script
        assert rec["role"] == "spare" and rec["x"] == x and rec["leaked"] is None
        assert rec["ppid"] == server and rec["torch"]  # forked, torch already imported
        assert rec["pgid"] == rec["pid"] == rec["sid"]  # a session of its own
        assert script in rec["cmdline"]  # ps shows the script, not the server
    # each child draws its own random numbers, as two fresh interpreters would
    assert starts[0]["random"] != starts[1]["random"]
    assert starts[0]["numpy"] != starts[1]["numpy"]
    # the interpreter's exit: non-daemon threads joined, then atexit, for each child
    assert [r.get("at") for r in records if "at" in r] == ["thread", "exit"] * 2


def test_an_exception_exits_1_and_a_spare_without_server_is_a_fresh_python(
    procs, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    ps = procs(str(out), "raise")
    ps.start_prefork()
    forked = ps.start_proc(0, ProcRole.SPARE)
    assert isinstance(forked, Forked) and forked.wait(timeout=60) == 1
    off = procs(str(out), "4", prefork=False)
    off.start_prefork()
    assert off.prefork is None
    plain = off.start_proc(0, ProcRole.SPARE)
    assert isinstance(plain, subprocess.Popen) and plain.wait(timeout=60) == 4
    ppids = [r["ppid"] for r in _records(out) if "argv" in r]
    assert ppids[0] == ps.prefork.proc.pid and ppids[1] == os.getpid()


def test_the_server_refuses_a_wrong_secret_and_goes_on_serving(procs, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    ps = procs(str(out), "0")
    ps.start_prefork()
    assert ps.prefork is not None and ps.prefork._await_listening()
    assert os.stat(ps.prefork.path).st_mode & 0o777 == 0o600
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(ps.prefork.path)
    with pytest.raises(AuthenticationError):
        client_handshake(Connection(sock), secrets.token_bytes(32), JOB)
    sock.close()
    assert ps.start_proc(0, ProcRole.SPARE).wait(timeout=60) == 0
    assert len([r for r in _records(out) if "argv" in r]) == 1


def test_a_spare_outlives_a_dead_server_and_its_exit_is_still_seen(procs, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    ps = procs(str(out), "wait")
    ps.start_prefork()
    spare = ps.start_proc(0, ProcRole.SPARE)
    assert isinstance(spare, Forked)
    deadline = time.monotonic() + 60
    while not _records(out) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ps.prefork is not None
    ps.prefork.proc.kill()
    ps.prefork.proc.wait(timeout=10)
    assert spare.poll() is None and psutil.pid_exists(spare.pid)
    Path(str(out) + ".go").touch()
    assert spare.wait(timeout=30) == 255  # its status died with the server: "unknown"
    # and a later spare starts as a fresh process
    (tmp_path / "out.jsonl.go").touch()
    later = ps.start_proc(0, ProcRole.SPARE)
    assert isinstance(later, subprocess.Popen) and later.wait(timeout=60) == 0


LAUNCHER = """
import secrets, subprocess, sys, time
from peerckpt.launch.processes import ProcessSet
ps = ProcessSet(sys.argv[3], secrets.token_bytes(32), [sys.argv[1]], sys.argv[2], {})
ps.start_prefork()
print(ps.prefork.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_server_exits_when_its_launcher_dies(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(script), str(tmp_path), JOB],
        stdout=subprocess.PIPE,
    )
    try:
        assert launcher.stdout is not None
        server = psutil.Process(int(launcher.stdout.readline()))
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        # it may still be importing torch: it exits once it looks (every 0.5 s after that)
        server.wait(timeout=90)
        assert not (tmp_path / "prefork.sock").exists()
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(timeout=10)
        assert launcher.stdout is not None
        launcher.stdout.close()


def test_the_servers_socket_appears_only_once_it_listens(tmp_path, monkeypatch) -> None:
    """The launcher connects as soon as the path exists: bound there before ``listen``, a
    connection in between was refused and the spares started without the server (CI)."""
    from peerckpt.launch import prefork

    path = str(tmp_path / "prefork.sock")
    seen: list[bool] = []
    listen = socket.socket.listen

    def watched(sock: socket.socket, backlog: int) -> None:
        seen.append(os.path.exists(path))
        listen(sock, backlog)

    monkeypatch.setattr(socket.socket, "listen", watched)
    listener = prefork._listen(path)
    try:
        assert seen == [False]
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(path)  # listening at the moment it appears
        client.close()
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    finally:
        listener.close()
