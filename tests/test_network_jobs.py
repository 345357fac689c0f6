"""Whole jobs seen from the network: no listener on a wildcard address, and a job whose every
TCP link is TLS (forced on loopback) replicates and recovers bit for bit."""

from __future__ import annotations

import json
import re
import time

import psutil
import pytest

from .conftest import JobRun, _job_processes, assert_same_digests, launch, run_job

WILDCARDS = {"0.0.0.0", "::", "*"}


def _listeners() -> dict[int, list[str]]:
    """pid → the addresses its TCP listeners are bound to, for every process of our jobs."""
    found: dict[int, list[str]] = {}
    for proc in _job_processes():
        try:
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        addrs = [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
        if addrs:
            found[proc.pid] = addrs
    return found


@pytest.mark.parametrize("tls", ["auto", pytest.param("on", marks=pytest.mark.slow)])
def test_no_listener_on_a_wildcard_address_during_a_job(tmp_path, monkeypatch, tls) -> None:
    """torch's TCPStore listened on every interface; the coordinator now binds it itself."""
    monkeypatch.setenv("PEERCKPT_TLS", tls)
    proc = launch(tmp_path, script_args=["--steps", "40", "--sleep", "0.1"])
    seen: dict[int, list[str]] = {}
    try:
        deadline = time.monotonic() + 120.0
        # coordinator, 2 agents and 4 ranks (each with its gloo listener) all listening
        while time.monotonic() < deadline and proc.poll() is None and len(seen) < 7:
            for pid, addrs in _listeners().items():
                seen.setdefault(pid, [])
                seen[pid] = sorted(set(seen[pid]) | set(addrs))
            time.sleep(0.2)
    finally:
        log, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, log[-4000:]
    assert len(seen) >= 7, f"saw the listeners of only {len(seen)} processes: {seen}"
    wild = {pid: addrs for pid, addrs in seen.items() if set(addrs) & WILDCARDS}
    assert not wild, f"listeners on a wildcard address: {wild}"


@pytest.mark.slow  # make test: tests/replication/test_tls.py, tests/recovery/test_rpc_auth.py
def test_a_job_with_tls_forced_replicates_and_recovers_bit_exact(
    tmp_path, monkeypatch, reference_run: JobRun
) -> None:
    """Every TCP link encrypted and mutually authenticated (data plane, gRPC, store gate):
    a killed rank is restored from its buddy over TLS and the bits equal the clear run's."""
    monkeypatch.setenv("PEERCKPT_TLS", "on")
    run = run_job(tmp_path, script_args=["--steps", "30"], spares=1, chaos="kill rank=2 at=10")
    assert run.returncode == 0, run.log[-4000:]
    assert_same_digests(run, reference_run)
    events = run.report["events"]
    assert len(events) == 1, json.dumps(events, indent=1)[:4000]
    [event] = events
    pulls = {p["rank"]: p for p in event["pulls"]}
    assert pulls[2]["source"] == 0 and pulls[2]["bytes"] > 0  # over the (TLS) data plane
    assert "store relay on 127.0.0.1:" in run.log  # ranks met through the authenticated gate
    # No peer refused by a listener or in a handshake (a stale report the coordinator
    # ignores after the epoch change, "coordinator refused Replicated: …", is not one).
    assert not re.search(r": refused \S+", run.log), "a listener refused a peer"
    assert "AuthenticationError" not in run.log and "handshake failed" not in run.log
