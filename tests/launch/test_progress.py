"""Progress reports (plain lines off a terminal, a bar on one) and JSON log records."""

from __future__ import annotations

import io
import json
import logging

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
