"""Every setting of a job refused before anything starts, with the flag and the fix
(``launch/checks.py``), alike from the command line and from the Python API."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from peerckpt.errors import ConfigurationError
from peerckpt.launch import checks
from peerckpt.launch.base import JobSpec
from peerckpt.launch.host import HostLauncher, HostSpec
from peerckpt.launch.local import LocalLauncher

from ..conftest import REPO

SCRIPT = str(REPO / "tests" / "jobs" / "ddp_job.py")
BASE = JobSpec(script=SCRIPT, nodes=2, nproc_per_node=1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"replicas": 5}, r"--replicas 5 needs at least 6 nodes.*use --replicas 1 or fewer"),
        ({"nodes": 1, "replicas": 1}, r"--replicas 1 needs at least 2 nodes.*use --replicas 0"),
        ({"replicas": -1}, r"--replicas -1: .*give --replicas 0 or more"),
        ({"min_nodes": 3}, r"--min-nodes 3 is more than the 2 node\(s\).*from 1 to 2"),
        ({"min_nodes": 0}, r"--min-nodes 0: .*give --min-nodes 1 or more"),
        ({"heartbeat_timeout": 0}, r"--heartbeat-timeout 0: give at least 0.5 seconds"),
        ({"heartbeat_timeout": 0.3}, r"--heartbeat-timeout 0.3: give at least 0.5 seconds"),
        ({"stall_timeout": 0.5}, r"--stall-timeout 0.5: give at least 1 seconds .*leave it out"),
        ({"heartbeat_timeout": float("nan")}, r"--heartbeat-timeout nan"),
        ({"heartbeat_timeout": float("inf")}, r"--heartbeat-timeout inf"),
        ({"start_timeout": -1.0}, r"start_timeout -1.0: give a positive"),
        ({"metrics_port": 99999}, r"--metrics-port 99999: a TCP port is 0 .* to 65535"),
        ({"metrics_port": -1}, r"--metrics-port -1"),
        ({"metrics_addr": ""}, r"--metrics-addr ''"),
        ({"nodes": 0}, r"--nodes 0: a job needs at least 1 node; give --nodes 1 or more"),
        ({"nodes": True}, r"--nodes True"),
        ({"nproc_per_node": 0}, r"--nproc-per-node 0: .*give --nproc-per-node 1 or more"),
        ({"spares": -2}, r"--spares -2: .*give --spares 0 or more"),
        ({"max_restarts": -1}, r"--max-restarts -1: 0 turns .*give --max-restarts 0 or more"),
        ({"placement": "star"}, r"--placement 'star': choose one of ring, group, mixed"),
        ({"racks": {0: "a"}}, r"--racks names 1 rack\(s\) for 2 node\(s\)"),
        ({"racks": {0: "a", 1: " "}}, r"one non-empty name per node"),
        ({"report": "/nonexistent-folder/report.json"}, r"the folder /nonexistent-folder"),
        ({"env": {"RANK": "3"}}, r"--env RANK: peerckpt sets RANK itself"),
        ({"env": {"A=B": "3"}}, r"--env 'A=B'"),
        ({"job": "Bad Name"}, r"job name 'Bad Name' must be"),
        ({"script": "/nonexistent/train.py"}, r"training script '/nonexistent/train.py' does not"),
        ({"args": ["--lr", 3]}, r"the script's arguments"),
    ],
)
def test_a_setting_that_cannot_work_is_refused_with_its_fix(fields: dict, message: str) -> None:
    spec = replace(BASE, **fields)
    with pytest.raises(ConfigurationError, match=message):
        spec.check()
    with pytest.raises(ConfigurationError, match=message):
        LocalLauncher(spec)  # the Python API refuses it too, before anything starts


def test_settings_at_their_limits_are_accepted() -> None:
    replace(
        BASE,
        replicas=1,
        min_nodes=2,
        heartbeat_timeout=checks.MIN_HEARTBEAT_TIMEOUT_S,
        metrics_port=65535,
        racks={0: "a", 1: "b"},
        env={"NCCL_DEBUG": "INFO", "EMPTY": ""},
        report=os.path.join(tempfile.gettempdir(), "report.json"),
    ).check()
    replace(BASE, nodes=1, replicas=0, min_nodes=1, metrics_port=0, max_restarts=0).check()
    replace(BASE, keep_spares=True).check()  # the campaign's spec: no spares to keep is no harm


def test_one_host_of_several_refuses_spares_and_counts_its_nodes_with_nnodes() -> None:
    host = HostSpec(2, 0, "127.0.0.1:29400", "127.0.0.1")
    with pytest.raises(ConfigurationError, match=r"--spares 1 with --rdzv-endpoint.*--spare-host"):
        checks.check_host(replace(BASE, spares=1, job="j"), host)
    with pytest.raises(ConfigurationError, match=r"--keep-spares with --rdzv-endpoint"):
        checks.check_host(replace(BASE, keep_spares=True, job="j"), host)
    # --nodes is not what counts on several hosts: the message names --nnodes
    with pytest.raises(ConfigurationError, match=r"\(--nnodes 2\).*or more --nnodes"):
        HostLauncher(replace(BASE, nodes=5, replicas=2, job="j"), host, b"s" * 32)
    checks.check_host(replace(BASE, nodes=1, replicas=1, job="j"), host)


@pytest.mark.parametrize(
    ("given", "mode", "message"),
    [
        ({"--nnodes": 2}, checks.LOCAL, r"--nnodes without --rdzv-endpoint: it is for one host"),
        ({"--spare-host": True}, checks.LOCAL, r"--spare-host without --rdzv-endpoint"),
        ({"--secret-file": "s"}, checks.LOCAL, r"--secret-file without --rdzv-endpoint"),
        ({"--nodes": 2, "--nnodes": 2, "--node-rank": 0}, checks.HOSTS, r"give .* as --nnodes"),
        ({"--spares": 1, "--nnodes": 2, "--node-rank": 0}, checks.HOSTS, r"--spare-host"),
        ({"--nnodes": 2}, checks.HOSTS, r"--rdzv-endpoint needs --nnodes and --node-rank"),
        ({"--rdzv-endpoint": "h:1"}, checks.RAY, r"with --ray: Ray places the hosts itself"),
        ({"--node-addr": "10.0.0.1"}, checks.RAY, r"--node-addr with --ray"),
        ({"--keep-spares": True}, checks.LOCAL, r"add --spares 1 \(or more\)"),
        ({"--keep-spares": True, "--spares": 0}, checks.RAY, r"add --spares 1"),
        ({"--tls-cert": "/nonexistent.pem"}, checks.LOCAL, r"--tls-cert /nonexistent.pem: no"),
    ],
)
def test_a_flag_that_means_nothing_where_it_is_given_is_refused(
    given: dict, mode: str, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        checks.check_run_flags(given, mode)


def test_flags_in_their_mode_are_accepted() -> None:
    checks.check_run_flags({"--nodes": 2, "--spares": 1, "--keep-spares": True}, checks.LOCAL)
    checks.check_run_flags({"--nodes": 2, "--spares": 1, "--keep-spares": True}, checks.RAY)
    hosts = {"--nnodes": 2, "--node-rank": 0, "--rdzv-endpoint": "h:1", "--spare-host": True}
    checks.check_run_flags(hosts, checks.HOSTS)


def test_a_ray_job_without_a_cluster_address_is_refused_before_ray_is_touched() -> None:
    pytest.importorskip("ray")
    from peerckpt.launch.ray import RayLauncher

    with pytest.raises(ConfigurationError, match=r"--ray '': give the Ray cluster's address"):
        RayLauncher(BASE, address="")
    with pytest.raises(ConfigurationError, match=r"--replicas 2 needs at least 3 nodes"):
        RayLauncher(replace(BASE, replicas=2), address="auto")


def test_env_is_parsed_a_later_key_winning_and_an_item_without_value_refused() -> None:
    assert checks.parse_env(["A=1", "B=x=y", "A=2", "C="]) == {"A": "2", "B": "x=y", "C": ""}
    assert checks.parse_env(None) == {}
    for bad in ("A", "=1"):
        with pytest.raises(ConfigurationError, match=r"give KEY=VALUE"):
            checks.parse_env([bad])


def test_join_plan_and_chaos_settings_are_refused_with_their_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"--nproc-per-node 0"):
        checks.check_join(0, None)
    with pytest.raises(ConfigurationError, match=r"training script 'nope.py'"):
        checks.check_join(None, ["nope.py"])
    with pytest.raises(ConfigurationError, match=r"use --replicas 3 or fewer"):
        checks.check_plan(4, 4, 1, None)
    with pytest.raises(ConfigurationError, match=r"--nodes 1: a node must survive each fault"):
        checks.check_campaign(3, 1, None, 5)
    with pytest.raises(ConfigurationError, match=r"--every 0"):
        checks.check_campaign(3, 3, 0, 5)
    with pytest.raises(ConfigurationError, match=r"--json /nonexistent/x.json"):
        checks.check_campaign(3, 3, None, 5, "/nonexistent/x.json")


def _cli(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "peerckpt.launch", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--replicas", "5", "--nodes", "2"], "--replicas 5 needs at least 6 nodes"),
        (["run", "--min-nodes", "3", "--nodes", "2"], "--min-nodes 3 is more than the 2"),
        (["run", "--heartbeat-timeout", "0"], "--heartbeat-timeout 0.0: give at least 0.5"),
        (["run", "--metrics-port", "99999"], "--metrics-port 99999: a TCP port"),
        (["run", "--nodes", "-1"], "--nodes -1: a job needs at least 1 node"),
        (["run", "--max-restarts", "-1"], "--max-restarts -1: 0 turns restarting in place off"),
        (["run", "--env", "NOVALUE"], "--env 'NOVALUE': give KEY=VALUE"),
        (
            ["run", "--spares", "1", "--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "2"],
            "--spares with --rdzv-endpoint",
        ),
        (["chaos", "--seed", "1", "--faults", "1", "--nodes", "1"], "--nodes 1: a node must"),
        (["join", "--job", "j", "--nproc-per-node", "0"], "--nproc-per-node 0"),
        (["plan", "--nodes", "2", "--replicas", "2", "--failures", "1"], "--replicas 2 needs"),
    ],
)
def test_the_command_line_exits_2_naming_the_problem_before_anything_starts(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    script_arg = [] if argv[0] in ("join", "plan") else [str(script)]
    run = _cli(*argv, *script_arg, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("peerckpt: ") and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert list(tmp_path.iterdir()) == [script]  # no report, no job file, nothing else


def test_help_speaks_to_users_and_version_is_the_package_version() -> None:
    from importlib.metadata import version

    helped = _cli("--help")
    assert helped.returncode == 0
    assert "Its length" not in helped.stdout and "argparse" not in helped.stdout
    assert "peerckpt run train.py" in helped.stdout
    shown = _cli("--version")
    assert shown.returncode == 0 and shown.stdout.strip() == f"peerckpt {version('peerckpt')}"


@pytest.mark.parametrize(
    ("value", "said"),
    [("0", "PEERCKPT_STALL_TIMEOUT 0.0: give at least 1 seconds"), ("soon", "'soon': give")],
)
def test_torchruns_stall_timeout_is_checked_as_the_flag_is(value: str, said: str) -> None:
    """Under torchrun the coordinator takes it from the environment: 0 (meant as "off") had
    fenced every rank not in a collective at each step."""
    from peerckpt.launch.checks import check_stall_timeout

    with pytest.raises(ConfigurationError, match=re.escape(said)):
        check_stall_timeout("PEERCKPT_STALL_TIMEOUT", value)
    assert check_stall_timeout("PEERCKPT_STALL_TIMEOUT", "90") == 90.0
