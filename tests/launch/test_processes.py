"""Starting a job's processes: a process that exits with ExitCode.RESTART, or that the
coordinator orders restarted, is replaced in place."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from peerckpt.launch.processes import Node, ProcessSet, wait_all
from peerckpt.states import ExitCode, ProcRole

# Records its role and restart count, then asks for a restart until its third incarnation.
SCRIPT = """
import json, os, sys
n = int(os.environ.get("PEERCKPT_RESTARTS", "0"))
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"role": os.environ["PEERCKPT_ROLE"], "restarts": n,
                        "node": os.environ["PEERCKPT_NODE"], "extra": os.environ.get("X")}) + "\\n")
sys.exit(EXIT_CODE if n < 2 else 3)
""".replace("EXIT_CODE", str(int(ExitCode.RESTART)))

# Records its role, node and X, and exits (a rank hangs first: it is ``kill``ed).
RECORD = """
import json, os, sys, time
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"role": os.environ["PEERCKPT_ROLE"], "node": os.environ["PEERCKPT_NODE"],
                        "extra": os.environ.get("X")}) + "\\n")
if os.environ["PEERCKPT_ROLE"] == "rank":
    time.sleep(600)
"""


def test_a_process_that_asks_for_a_restart_gets_a_fresh_spare_on_its_node(tmp_path: Path) -> None:
    script, record = tmp_path / "proc.py", tmp_path / "record.jsonl"
    script.write_text(SCRIPT)
    procs = ProcessSet("job", b"s", [str(script), str(record)], str(tmp_path), {})
    procs.nodes[1] = Node(1, subprocess.Popen([sys.executable, "-c", "pass"]), "sock")
    procs.start_proc(1, ProcRole.RANK)
    started = []
    try:
        deadline = time.monotonic() + 60.0
        while len(started) < 2 and time.monotonic() < deadline:
            started += procs.restart_stuck(X="y")
            time.sleep(0.05)
        assert [(node, old) for node, old, _ in started] == [
            (1, procs.nodes[1].procs[0].pid),
            (1, procs.nodes[1].procs[1].pid),
        ]
        wait_all(procs.nodes[1].procs, 30.0)
        assert procs.nodes[1].procs[2].returncode == 3  # gave up: not restarted again
        assert procs.restart_stuck() == []
        lines = [json.loads(x) for x in record.read_text().splitlines()]
        assert lines == [
            {"role": "rank", "restarts": 0, "node": "1", "extra": None},
            {"role": "spare", "restarts": 1, "node": "1", "extra": "y"},
            {"role": "spare", "restarts": 2, "node": "1", "extra": "y"},
        ]
    finally:
        for proc in [procs.nodes[1].agent, *procs.nodes[1].procs]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def test_an_ordered_restart_in_place_starts_one_spare_on_the_node_for_its_own_process(
    tmp_path: Path,
) -> None:
    """The coordinator's order (``JobStatus.in_place``) repeats in every status until the
    fresh process joins: it is carried out once, and only for a process this set started."""
    script, record = tmp_path / "proc.py", tmp_path / "record.jsonl"
    script.write_text(RECORD)
    procs = ProcessSet("job", b"s", [str(script), str(record)], str(tmp_path), {})
    procs.nodes[0] = Node(0, subprocess.Popen([sys.executable, "-c", "pass"]), "sock")
    rank = procs.start_proc(0, ProcRole.RANK)
    lost = rank.pid
    try:
        deadline = time.monotonic() + 60.0
        while not (record.exists() and record.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procs.restart_in_place({1: [0, 999_999_999]}) == []  # not a process of ours
        assert procs.restart_in_place({1: [5, lost]}) == []  # not a node of ours
        # Declared lost while alive (a hang): killed before its successor starts.
        [(node, old, new)] = procs.restart_in_place({1: [0, lost]}, X="y")
        assert (node, old) == (0, lost) and new == procs.nodes[0].procs[1].pid
        assert rank.returncode == -9
        assert procs.restart_in_place({1: [0, lost]}) == []  # the same order, seen again
        wait_all(procs.nodes[0].procs, 30.0)
        lines = [json.loads(x) for x in record.read_text().splitlines()]
        assert lines == [
            {"role": "rank", "node": "0", "extra": None},
            {"role": "spare", "node": "0", "extra": "y"},
        ]
        procs.nodes[0].alive = False  # a node killed: nothing is started there any more
        assert procs.restart_in_place({3: [0, new]}) == []
    finally:
        for proc in [procs.nodes[0].agent, *procs.nodes[0].procs]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
