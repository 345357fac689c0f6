"""Progress reports (plain lines off a terminal, a bar on one) and JSON log records."""

from __future__ import annotations

import io
import json
import logging
from dataclasses import replace

from peerckpt import logs
from peerckpt.launch import progress
from peerckpt.launch.progress import Report


def test_off_a_terminal_progress_is_a_few_plain_lines(monkeypatch) -> None:
    out = io.StringIO()
    clock = iter([0.0, 0.0, 0.5, 1.0, 2.5, 3.0, 9.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    with Report("verifying", 5, "chunks", stream=out) as report:
        for _ in range(5):
            report.advance()
    lines = out.getvalue().splitlines()
    # The first update prints, the next ones only once PLAIN_EVERY_S passed, and the end.
    assert lines == [
        "verifying: 1/5 chunks (20%)",
        "verifying: 4/5 chunks (80%)",
        "verifying: 5/5 chunks (100%)",
    ]


def test_work_shorter_than_the_delay_prints_nothing() -> None:
    out = io.StringIO()
    with Report("exporting", 3, stream=out, delay_s=60.0) as report:
        report.update(3)
    assert out.getvalue() == ""


def test_on_a_terminal_progress_is_a_bar() -> None:
    out = io.StringIO()
    with Report("verifying", 4, "chunks", stream=out, terminal=True) as report:
        report.update(4)
    text = out.getvalue()
    assert "verifying" in text and "4/4" in text and "\n" not in text.rstrip("\n").split("4/4")[1]


def test_json_log_records_carry_rank_epoch_and_step(monkeypatch) -> None:
    monkeypatch.setenv(logs.ENV, "json")
    record = logging.LogRecord("peerckpt.rank", logging.WARNING, __file__, 1, "lost %d", (3,), None)
    record.rank, record.epoch, record.step = 2, 1, "-"
    line = logs.formatter("rank", "%(message)s").format(record)
    got = json.loads(line)
    assert got["message"] == "lost 3" and got["level"] == "WARNING" and got["process"] == "rank"
    assert got["rank"] == 2 and got["epoch"] == 1 and "step" not in got
    monkeypatch.setenv(logs.ENV, "text")
    assert logs.formatter("rank", "%(levelname)s %(message)s").format(record) == "WARNING lost 3"


def test_a_long_recovery_reports_the_ranks_stepping_again(monkeypatch) -> None:
    from peerckpt.launch.progress import RecoveryProgress
    from peerckpt.launch.view import build_view
    from tests.launch.observed import EVENT, status

    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    watch = RecoveryProgress(stream=out, delay_s=3.0)
    repairing = [replace(EVENT, resumed_at=None)]
    for t, resumed in ((0.0, []), (1.0, [0]), (4.0, [0, 1]), (7.0, [0, 1, 2])):
        now[0] = t
        s = status(events=repairing, resumed=resumed)
        watch(s, build_view(s))
    now[0] = 8.0
    done = status()  # resumed: the recovery is over
    watch(done, build_view(done))
    lines = out.getvalue().splitlines()
    # Nothing for the first 3 s; then plain lines (not a terminal), and the end at 4/4.
    assert [line.split(": ")[-1] for line in lines] == [
        "2/4 ranks stepping again (50%)",
        "3/4 ranks stepping again (75%)",
        "4/4 ranks stepping again (100%)",
    ], lines
    assert lines[0].startswith("recovering from rank: process 200 exited (restoring step 30)")
