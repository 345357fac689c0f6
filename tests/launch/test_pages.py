"""The status page (parsed as HTML), the terminal view, and the timeline drawn from a report."""

from __future__ import annotations

import io
import json
import struct
from html.parser import HTMLParser

import pytest
from rich.console import Console

from peerckpt.errors import ConfigurationError
from peerckpt.launch import console, statuspage
from peerckpt.launch.base import JobOutcome, JobResult
from peerckpt.launch.timeline import DPI, HEIGHT_IN, WIDTH_IN, timeline, timeline_data
from peerckpt.launch.view import build_view
from peerckpt.states import JobState
from tests.launch.observed import CHAOS, T0, status


class Tables(HTMLParser):
    """Every table by id: its rows, each a dict of data-field → text; and the refresh."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[dict[str, str]]] = {}
        self.refresh: str | None = None
        self._table: str | None = None
        self._row: dict[str, str] | None = None
        self._field: str | None = None
        self.open_tags: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        a = dict(attrs)
        if tag not in ("meta", "br"):
            self.open_tags.append(tag)
        if tag == "meta" and a.get("http-equiv") == "refresh":
            self.refresh = a["content"]
        if tag == "table":
            self._table = a["id"]
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self._row = {}
        elif tag == "td" and self._row is not None and "data-field" in a:
            self._field = a["data-field"]
            self._row[self._field] = ""

    def handle_endtag(self, tag) -> None:
        assert self.open_tags and self.open_tags[-1] == tag, f"</{tag}> closes {self.open_tags}"
        self.open_tags.pop()
        if tag == "td":
            self._field = None
        elif tag == "tr" and self._row:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data) -> None:
        if self._field is not None and self._row is not None:
            self._row[self._field] += data


def _parse(page: str) -> Tables:
    parser = Tables()
    parser.feed(page)
    parser.close()
    assert parser.open_tags == [], f"unclosed: {parser.open_tags}"
    return parser


def test_the_status_page_is_well_formed_and_shows_nodes_ranks_and_recoveries() -> None:
    page = statuspage.render(build_view(status(), chaos=CHAOS))
    parsed = _parse(page)
    assert parsed.refresh == str(statuspage.REFRESH_S)
    summary = {k: v for row in parsed.tables["summary"] for k, v in row.items()}
    assert summary["committed step"] == "41" and summary["durable step"] == "20"
    assert summary["replication lag"] == "3 step(s)"
    nodes = {r["node"]: r for r in parsed.tables["nodes"]}
    assert nodes["2"]["health"] == "alive (spare node)" and nodes["2"]["ranks"] == "2"
    assert nodes["1"]["replicas"] == "8.0 KiB"
    ranks = {r["rank"]: r for r in parsed.tables["ranks"]}
    assert ranks["2"]["copies"] == "1, 2" and ranks["2"]["node"] == "2"
    assert ranks["0"]["lag"] == "3"
    (rec,) = parsed.tables["recoveries"]
    assert rec["cause"] == "kill rank=2 at=30" and rec["total"] == "250 ms"
    assert rec["detection"] == "20 ms" and rec["transfer"] == "30 ms"


def test_the_status_page_escapes_what_the_job_says() -> None:
    s = status(reason="<script>alert(1)</script>", state=JobState.FAILED)
    page = statuspage.render(build_view(s))
    assert "<script>" not in page and "&lt;script&gt;" in page
    _parse(page)


def test_the_terminal_view_shows_every_node_and_rank() -> None:
    out = io.StringIO()
    Console(file=out, width=160).print(console.render(build_view(status(), chaos=CHAOS)))
    text = out.getvalue()
    assert "job demo running" in text and "committed step 41" in text
    assert "durable step 20" in text and "lag 3" in text
    assert "alive (spare node)" in text and "kill rank=2 at=30" in text and "250 ms" in text
    rank_lines = [line for line in text.splitlines() if "│ 1, 2 " in line]
    assert rank_lines, text  # rank 2's copies on nodes 1 and 2


def test_status_refuses_a_secret_file_others_can_read(tmp_path, monkeypatch) -> None:
    path = tmp_path / "secret"
    path.write_text("ab" * 16)
    path.chmod(0o644)
    with pytest.raises(ConfigurationError, match="chmod 600"):
        console.connect("demo", "127.0.0.1:1", str(path))
    monkeypatch.delenv("PEERCKPT_SECRET", raising=False)
    with pytest.raises(ConfigurationError, match="PEERCKPT_SECRET"):
        console.connect("demo", "127.0.0.1:1", None)


def _report() -> JobResult:
    s = status()
    return JobResult(
        "demo",
        0,
        JobOutcome.SUCCEEDED,
        "",
        s.events,
        CHAOS,
        20.0,
        s.flushes,
        timeline={
            "started_at": T0,
            "steps": [[T0 + 1 + 0.1 * i, r, i] for i in range(60) for r in range(4)],
            "commits": [[T0 + 1 + 0.1 * i, i] for i in range(60)],
            "epochs": [[T0 + 1, 0, 4], [T0 + 10.1, 1, 4]],
        },
    )


def test_the_timeline_data_holds_every_fault_of_the_run() -> None:
    data = timeline_data(_report())
    causes = [f["cause"] for f in data["faults"]]
    # The kill (a lost rank) and the slow link (nothing lost) are faults of the run; the
    # action that never fired is listed apart.
    assert causes == ["kill rank=2 at=30", "slow node=0 at=35 rate=2 for=2"]
    assert data["skipped"] == ["kill rank=1 at=999"]
    kill = data["faults"][0]
    assert kill["fault_s"] == 10.0 and kill["detected_s"] == 10.02 and kill["resumed_s"] == 10.25
    assert kill["kind"] == "rank" and kill["lost"] == {"2": 1}
    assert data["faults"][1]["kind"] == "no loss"
    assert len(data["ranks"]) == 4 and data["ranks"]["3"][0] == [1.0, 0]
    assert data["flushes"][0] == {"step": 20, "state": "committed", "start_s": 5.0, "end_s": 6.0}


def test_the_timeline_picture_has_the_expected_size(tmp_path) -> None:
    report = tmp_path / "report.json"
    report.write_text(json.dumps(_report().to_json()))
    data = timeline(str(report), str(tmp_path / "run.png"), str(tmp_path / "run.json"))
    raw = (tmp_path / "run.png").read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", raw[16:24])
    assert (width, height) == (int(WIDTH_IN * DPI), int(HEIGHT_IN * DPI))
    assert json.loads((tmp_path / "run.json").read_text()) == json.loads(json.dumps(data))


def test_timeline_names_a_file_that_is_not_a_report(tmp_path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigurationError, match="not a job report"):
        timeline(str(bad), str(tmp_path / "x.png"))
