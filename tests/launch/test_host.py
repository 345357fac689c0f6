"""The multi-host flags of ``peerckpt run``: bad combinations refused with the fix."""

from __future__ import annotations

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
