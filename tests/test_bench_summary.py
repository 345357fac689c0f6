"""The summary under docs/performance.md's table: every missed goal says its measured cause
and what would remove it (issue 17's rule for `make bench`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import summary  # noqa: E402
from remedies import remedy  # noqa: E402


def _missed() -> list[tuple[str, str]]:
    out = []
    for path in sorted((BENCH / "results").glob("*.json")):
        if path.stem.endswith("-quick"):
            continue
        r = json.loads(path.read_text())
        targets = r.get("targets") or summary._derived_targets(path.stem, r)
        out += [(path.stem, key) for key, t in targets.items() if t.get("met") is False]
    return out


def test_every_goal_the_committed_results_miss_has_a_remedy() -> None:
    missed = _missed()
    assert missed, "the committed results miss goals: this test must see them"
    assert [m for m in missed if remedy(*m) is None] == []


def test_the_summary_writes_cause_and_remedy_of_a_missed_goal() -> None:
    table = summary.build()
    [line] = [x for x in table.splitlines() if x.startswith("- **recovery transfer, 256 MiB: /")]
    assert "The transfer ran at" in line  # the cause the benchmark measured
    assert "*What would remove it*: a spare node's agent creating" in line
    assert "not known yet" not in table


def test_a_missed_goal_without_a_remedy_says_so(monkeypatch) -> None:
    monkeypatch.setattr(summary, "remedy", lambda name, key: None)
    assert "*What would remove it*: not known yet." in summary.build()
