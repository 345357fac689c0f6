"""``peerckpt chaos``: a seeded campaign of random faults, compared snapshot for snapshot with a
fault-free run of the same job."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from peerckpt.chaos.campaign import Campaign, compare, generate
from peerckpt.chaos.spec import parse_chaos
from peerckpt.launch.base import JobResult
from peerckpt.launch.timeline import timeline_data

from .conftest import JOBS, REPO, job_name


def test_the_sequence_depends_only_on_the_seed_and_parses() -> None:
    first = generate(7, 20, world=3, start=5, every=10, heartbeat_s=2.0)
    assert first == generate(7, 20, world=3, start=5, every=10, heartbeat_s=2.0)
    assert first != generate(8, 20, world=3, start=5, every=10, heartbeat_s=2.0)
    assert len(first) == 20
    actions = parse_chaos("; ".join(first))
    assert len({a.kind for a in actions}) >= 4  # a mix, not one fault twenty times
    # One fault every 10 steps; a kill timed inside a recovery shares its first kill's step.
    assert actions[0].at == 5 and all(
        b.at - a.at in (0, 10) for a, b in itertools.pairwise(actions)
    )


def _result(digests: dict[str, list[str]], chaos: list[dict]) -> JobResult:
    return JobResult("j", 0, "succeeded", "", [], chaos, 1.0, [], digests)


def test_a_snapshot_that_differs_from_the_reference_fails_its_row_and_the_campaign() -> None:
    reference = {f"{r}/{s}": [f"d{r}{s}"] for r in range(2) for s in range(20)}
    chaos = [
        {
            "action": "corrupt rank=0 at=5",
            "kind": "corrupt_rank",
            "target": 0,
            "committed_step": 4,
            "fired_at": 1.0,
        },
        {
            "action": "slow node=@1 at=10 rate=2",
            "kind": "slow_node",
            "target": -1,
            "committed_step": 9,
            "fired_at": 2.0,
            "node": 1,
        },
    ]
    same = Campaign(1, [c["action"] for c in chaos], job_state="succeeded")
    compare(same, _result(reference, []), _result(dict(reference), chaos))
    assert same.ok and [r.bit_exact for r in same.rows] == [True, True]

    bad = dict(reference)
    bad["1/12"] = ["d112", "other"]  # step 12 trained again after the second fault, differently
    broken = Campaign(1, [c["action"] for c in chaos], job_state="succeeded")
    compare(broken, _result(reference, []), _result(bad, chaos))
    assert [r.bit_exact for r in broken.rows] == [True, False]
    assert broken.differing == ["rank 1 step 12"] and not broken.ok

    missing = {k: v for k, v in reference.items() if k != "0/19"}
    gap = Campaign(1, [c["action"] for c in chaos], job_state="succeeded")
    compare(gap, _result(reference, []), _result(missing, chaos))
    assert gap.differing == ["rank 0 step 19 missing"] and not gap.ok


def _campaign(tmp_path, seed: int, faults: int, steps: int) -> dict:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "peerckpt",
            "chaos",
            "--seed",
            str(seed),
            "--faults",
            str(faults),
            "--json",
            str(out),
            "--job",
            job_name(),
            str(JOBS / "ddp_job.py"),
            str(tmp_path),
            "--steps",
            str(steps),
            "--sleep",
            "0.3",
        ],
        cwd=REPO,
        env=dict(os.environ, PEERCKPT_LOG_LEVEL="WARNING"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    report: dict = json.loads(out.read_text())
    assert report["ok"] and report["leaks"] == [] and report["differing"] == []
    assert len(report["rows"]) == faults
    assert all(r["bit_exact"] and r["step"] is not None for r in report["rows"])
    assert "campaign passed" in proc.stdout
    # The chaos run's report and its timeline, beside the campaign's JSON; the drawn data
    # holds every fault the campaign fired.
    stem = str(out)[: -len(".json")]
    picture = Path(f"{stem}-timeline.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"its timeline: {picture}" in proc.stdout
    data = timeline_data(json.loads(Path(f"{stem}-report.json").read_text()))
    drawn = [f["cause"] for f in data["faults"]]
    fired = [r["fault"] for r in report["rows"] if r["step"] is not None]
    assert not Counter(fired) - Counter(drawn), (fired, drawn)
    return report


def test_a_campaign_of_five_faults_ends_bit_exact_with_nothing_left(tmp_path) -> None:
    report = _campaign(tmp_path, seed=1, faults=5, steps=60)
    recovered = [r for r in report["rows"] if r["recovered_s"] is not None]
    assert recovered, "no fault of the campaign made a recovery"


@pytest.mark.slow
def test_a_campaign_of_twenty_faults_over_three_nodes(tmp_path) -> None:
    report = _campaign(tmp_path, seed=2, faults=20, steps=225)
    assert sum(r["recovered_s"] is not None for r in report["rows"]) >= 10
