"""A rank process's uncaught exception is left for its launcher (``peerckpt/exitnote.py``)."""

from __future__ import annotations

import subprocess
import sys

from peerckpt import exitnote

_SCRIPT = """
import sys
from peerckpt import exitnote
exitnote.install(sys.argv[1])
raise {raised}
"""


def _run(tmp_path, raised: str) -> subprocess.CompletedProcess[str]:
    code = _SCRIPT.format(raised=raised)
    return subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )


def test_the_uncaught_exceptions_line_is_left_and_the_traceback_still_printed(tmp_path) -> None:
    done = _run(tmp_path, "ValueError(\"no column named 'label'\\nin the csv\")")
    assert done.returncode == 1 and "Traceback (most recent call last)" in done.stderr
    [note] = list(tmp_path.glob("exit-*.txt"))
    pid = int(note.name[len("exit-") : -len(".txt")])
    assert exitnote.read(str(tmp_path), pid) == "ValueError: no column named 'label' in the csv"
    assert exitnote.read(str(tmp_path), pid + 1) is None  # another process left nothing


def test_ctrl_c_leaves_nothing(tmp_path) -> None:
    _run(tmp_path, "KeyboardInterrupt")
    assert list(tmp_path.iterdir()) == []
