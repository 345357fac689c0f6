"""``peerckpt plan``: exact survival odds and memory per node, checked against brute force."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from math import comb

import pytest

from peerckpt.recovery.placement import STRATEGY_NAMES, placement_by_name
from peerckpt.recovery.survival import copy_sets, count_by_enumeration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "peerckpt.launch", "plan", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _brute_force(name: str, nodes: int, replicas: int, failures: int) -> Fraction:
    rank_nodes = {node: node for node in range(nodes)}
    sets = copy_sets(rank_nodes, placement_by_name(name).buddies(rank_nodes, replicas))
    survived = count_by_enumeration(sets, range(nodes), failures)
    return Fraction(survived, comb(nodes, failures))


@pytest.mark.parametrize(("nodes", "replicas", "failures"), [(16, 2, 2), (16, 2, 3), (11, 1, 3)])
def test_json_probabilities_match_brute_force(nodes: int, replicas: int, failures: int) -> None:
    run = _plan(
        "--nodes", str(nodes), "--replicas", str(replicas), "--failures", str(failures), "--json"
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert [s["strategy"] for s in out["strategies"]] == list(STRATEGY_NAMES)
    for s in out["strategies"]:
        expected = _brute_force(s["strategy"], nodes, replicas, failures)
        assert Fraction(s["probability"]) == expected, s["strategy"]
        assert Fraction(s["recoverable_sets"], out["failure_sets"]) == expected


def test_sixteen_nodes_two_replicas_survive_any_two_failures() -> None:
    run = _plan("--nodes", "16", "--replicas", "2", "--failures", "2")
    assert run.returncode == 0, run.stderr
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines()[3:]}
    assert set(rows) == set(STRATEGY_NAMES)
    for row in rows.values():
        assert row[1:4] == ["120/120", "1", "100.0000%"]
    assert rows["ring"][4] == rows["mixed"][4] == "3·S"
    assert rows["group"][4:6] == ["up", "to"] and rows["group"][6] == "4·S"


def test_table_prints_the_fraction_and_percent_of_one_strategy() -> None:
    run = _plan("--nodes", "16", "--replicas", "2", "--failures", "3", "--strategy", "mixed")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 4 and lines[3].split()[:4] == ["mixed", "552/560", "69/70", "98.5714%"]


def test_state_bytes_gives_memory_in_bytes() -> None:
    run = _plan(
        "--nodes", "16", "--replicas", "2", "--failures", "3",
        "--state-bytes", "1000", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    most = {s["strategy"]: s["bytes_per_node_most"] for s in json.loads(run.stdout)["strategies"]}
    assert most == {"ring": 3000, "group": 4000, "mixed": 3000}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "4", "--replicas", "4", "--failures", "1"], "use --replicas 3 or fewer"),
        (["--nodes", "4", "--replicas", "1", "--failures", "5"], "use --failures from 0 to 4"),
        (["--nodes", "0", "--replicas", "0", "--failures", "0"], "at least 1 node"),
        (["--nodes", "4", "--replicas", "-1", "--failures", "0"], "--replicas -1"),
        (["--nodes", "4", "--replicas", "1", "--failures", "1", "--strategy", "star"], "mixed"),
    ],
)
def test_bad_input_is_refused_naming_the_problem(args: list[str], message: str) -> None:
    run = _plan(*args)
    assert run.returncode == 2
    assert message in run.stderr and run.stdout == ""


def test_run_refuses_racks_that_do_not_name_every_node() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "peerckpt.launch", "run", "--nodes", "4", "--racks", "a,b", "x.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "--racks names 2 rack(s) for 4 node(s)" in run.stderr
