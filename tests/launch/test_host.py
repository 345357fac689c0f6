"""The multi-host flags of ``peerckpt run``: bad combinations refused with the fix."""

from __future__ import annotations

import tempfile

import pytest

from peerckpt.errors import ConfigurationError
from peerckpt.launch.base import JobSpec
from peerckpt.launch.host import HostLauncher, HostSpec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rdzv_endpoint": "host-without-port"}, "must be HOST:PORT"),
        ({"rdzv_endpoint": "10.0.0.1:99999"}, "must be HOST:PORT"),
        ({"spare_host": True, "node_rank": 1}, "--node-rank 2 or more"),
        ({"nnodes": 0}, "--nnodes must be ≥ 1"),
    ],
)
def test_a_bad_host_spec_names_the_flag_and_the_fix(fields: dict, message: str) -> None:
    spec = {"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "10.0.0.1:29400", "node_addr": "10.0.0.2"}
    with pytest.raises(ConfigurationError, match=message):
        HostSpec(**{**spec, **fields})


def test_hosts_beyond_the_job_grow_it_or_hold_spares() -> None:
    base = {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:29400", "node_addr": "10.0.0.5"}
    assert HostSpec(node_rank=0, **base).runs_coordinator
    assert HostSpec(node_rank=3, **base).grows
    spare = HostSpec(node_rank=3, spare_host=True, **base)
    assert not spare.grows and not spare.runs_coordinator


def test_a_multi_host_job_needs_its_name(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    host = HostSpec(2, 1, "10.0.0.1:29400", "10.0.0.3")
    with pytest.raises(ConfigurationError, match="needs --job NAME"):
        HostLauncher(JobSpec(script=str(script)), host, b"s" * 32)


@pytest.mark.parametrize(
    ("chaos", "node_rank", "message"),
    [
        ("kill node=0 at=5", 1, "this is host 1; give it to the peerckpt run of host 0"),
        ("kill agent node=2 at=5", 1, "give it to the peerckpt run of host 2"),
        ("kill coordinator at=5", 1, "the coordinator runs on host 0"),
    ],
)
def test_a_host_refuses_chaos_for_another_host_before_starting(
    tmp_path, monkeypatch, chaos: str, node_rank: int, message: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    host = HostSpec(2, node_rank, "10.0.0.1:29400", "10.0.0.3")
    with pytest.raises(ConfigurationError, match=message):
        HostLauncher(JobSpec(script=str(script), job="j", chaos=chaos), host, b"s" * 32)
    assert list(temp.iterdir()) == []  # the run directory it had made is gone with it


def test_a_host_takes_its_own_node_faults_and_ranks_anywhere(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    host = HostSpec(2, 1, "10.0.0.1:29400", "10.0.0.3")
    chaos = "kill node=1 at=5; kill rank=0 at=6; add node at=7; kill node=@3 at=8"
    launcher = HostLauncher(JobSpec(script=str(script), job="j", chaos=chaos), host, b"s" * 32)
    assert launcher.chaos is not None and len(launcher.chaos.actions) == 4
    launcher.stop()


def test_the_coordinators_command_line_leaves_out_what_is_unset() -> None:
    from peerckpt.launch.processes import coordinator_argv

    argv = coordinator_argv("j", 4, min_nodes=None, restart_based=True, moved_from="10.0.0.1")
    assert argv[argv.index("--job") + 1] == "j" and argv[argv.index("--world-size") + 1] == "4"
    assert "--min-nodes" not in argv and "--restart-based" in argv
    assert argv[argv.index("--moved-from") + 1] == "10.0.0.1"
