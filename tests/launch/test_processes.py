"""Starting a job's processes: a process that exits with ExitCode.RESTART is replaced in place."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from peerckpt.launch.processes import Node, ProcessSet, wait_all
from peerckpt.states import ExitCode

# Records its role and restart count, then asks for a restart until its third incarnation.
SCRIPT = """
import json, os, sys
n = int(os.environ.get("PEERCKPT_RESTARTS", "0"))
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"role": os.environ["PEERCKPT_ROLE"], "restarts": n,
                        "node": os.environ["PEERCKPT_NODE"], "extra": os.environ.get("X")}) + "\\n")
sys.exit(EXIT_CODE if n < 2 else 3)
""".replace("EXIT_CODE", str(int(ExitCode.RESTART)))


def test_a_process_that_asks_for_a_restart_gets_a_fresh_spare_on_its_node(tmp_path: Path) -> None:
    script, record = tmp_path / "proc.py", tmp_path / "record.jsonl"
    script.write_text(SCRIPT)
    procs = ProcessSet("job", b"s", [str(script), str(record)], str(tmp_path), {})
    procs.nodes[1] = Node(1, subprocess.Popen([sys.executable, "-c", "pass"]), "sock")
    procs.start_proc(1, "rank")
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
