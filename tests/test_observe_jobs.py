"""Observing a running job: Prometheus metrics and the status page of ``peerckpt run
--metrics-port``, ``peerckpt status`` (--json, --once; the live view in tmux), the status page
in a real headless browser, and the timeline of the job's report."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, JobRun, assert_same_digests, launch, run_job
from tests.launch.test_pages import _parse

DEADLINE_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus-client's own parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "job"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_for(
    what: str, probe: Callable[[], Any], proc: subprocess.Popen[str], timeout: float = DEADLINE_S
) -> Any:
    """Poll ``probe`` (bounded in time) until it returns something true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the job ended while waiting for {what}"
        try:
            got = probe()
        except (urllib.error.URLError, ConnectionError, KeyError):
            got = None
        if got:
            return got
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


@contextlib.contextmanager
def _job(tmp_path: Path, sleep: float) -> Iterator[tuple[subprocess.Popen[str], int, str, Path]]:
    """A 2 × 2 job (the reference run's topology and steps) with a spare, metrics on a free
    port, slowed down by ``sleep`` a step so that it can be watched, and rank 1 killed at
    step 15. Yields (launcher process, metrics port, job name, output dir)."""
    port = _free_port()
    out = tmp_path / "job"
    proc = launch(
        out,
        script_args=["--steps", "30", "--sleep", str(sleep)],
        spares=1,
        chaos="kill rank=1 at=15",
        extra=["--metrics-port", str(port)],
    )
    job = proc.args[proc.args.index("--job") + 1]
    try:
        yield proc, port, job, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the launcher cleans up on Ctrl-C
        proc.communicate(timeout=60)


@pytest.fixture
def observed_job(tmp_path) -> Iterator[tuple[subprocess.Popen[str], int, str, Path]]:
    with _job(tmp_path, 0.15) as job:
        yield job


@pytest.fixture
def long_job(tmp_path) -> Iterator[tuple[subprocess.Popen[str], int, str, Path]]:
    """The same job at a second a step: long enough to be looked at from outside."""
    with _job(tmp_path, 1.0) as job:
        yield job


def _status_cli(job: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "peerckpt.launch", "status", "--job", job, *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_metrics_count_a_recovery_and_status_shows_the_running_job(
    observed_job, reference_run
) -> None:
    proc, port, job, out = observed_job
    step = ("peerckpt_committed_step", ())
    rank_kind = ("peerckpt_recoveries_total", (("kind", "rank"),))

    # Before the kill: something committed, no recovery yet.
    before = wait_for(
        "a committed step", lambda: (m := scrape(port)).get(step) is not None and m, proc
    )
    assert before[rank_kind] == 0 and before[("peerckpt_world_size", ())] == 4
    assert before[step] < 15, "scraped after the kill's step: nothing to compare"
    assert before[("peerckpt_epoch", ())] == 0

    # After it: exactly one recovery, of kind rank, and training went on past it.
    after = wait_for(
        "the recovery and more commits",
        lambda: (m := scrape(port))[rank_kind] == 1 and m[step] > before[step] + 2 and m,
        proc,
    )
    assert after[step] > before[step]
    assert after[("peerckpt_epoch", ())] == 1
    assert sum(v for (n, _), v in after.items() if n == "peerckpt_recoveries_total") == 1
    total = ("peerckpt_recovery_seconds_count", (("phase", "total"),))
    assert after[total] == 1
    assert after[("peerckpt_snapshot_bytes_total", (("node", "0"),))] > 0
    assert after[("peerckpt_replicated_bytes_total", (("node", "1"),))] > 0
    assert after[("peerckpt_memory_bytes", (("kind", "replicas"), ("node", "0")))] > 0

    # The status page of the same port, as a parser reads it.
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as resp:
        page = _parse(resp.read().decode())
    assert {r["node"] for r in page.tables["nodes"]} >= {"0", "1", "2"}
    assert [r["rank"] for r in page.tables["ranks"]] == ["0", "1", "2", "3"]
    assert page.tables["recoveries"][0]["cause"] == "kill rank=1 at=15"

    # peerckpt status on the same job: JSON for scripts, one text snapshot for humans.
    got = _status_cli(job, "--json")
    assert got.returncode == 0, got.stderr
    view = json.loads(got.stdout)
    assert view["job"] == job and view["state"] in ("running", "finishing", "succeeded")
    assert view["recoveries_total"]["rank"] == 1 and view["epoch"] == 1
    assert sorted(r["rank"] for r in view["ranks"]) == [0, 1, 2, 3]
    moved = next(r for r in view["ranks"] if r["rank"] == 1)
    assert moved["node"] == 2, "rank 1 now runs on the spare node"
    assert all(len(r["copies"]) == 2 for r in view["ranks"]), "each committed step on 2 nodes"
    once = _status_cli(job, "--once")
    assert once.returncode == 0, once.stderr
    assert f"job {job}" in once.stdout and "nodes" in once.stdout
    assert "alive (spare node)" in once.stdout and "rank: process" in once.stdout

    log, _ = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, log[-4000:]
    report = json.loads((out / "report.json").read_text())
    run = JobRun(proc.returncode, report, out, log)
    assert_same_digests(run, reference_run)

    # The timeline of this run: its data holds the fault, its picture exists.
    from peerckpt.launch.cli import main

    assert (
        main(
            [
                "timeline",
                str(out / "report.json"),
                "-o",
                str(out / "run.png"),
                "--data",
                str(out / "run.json"),
            ]
        )
        == 0
    )
    data = json.loads((out / "run.json").read_text())
    assert [f["cause"] for f in data["faults"]] == ["kill rank=1 at=15"]
    assert data["faults"][0]["resumed_s"] > data["faults"][0]["fault_s"]
    assert sorted(data["ranks"]) == ["0", "1", "2", "3"]
    assert (out / "run.png").stat().st_size > 10_000


def test_status_names_a_job_that_is_not_running() -> None:
    got = _status_cli("nosuchjob_here", "--once")
    assert got.returncode == 2 and "no running job named 'nosuchjob_here'" in got.stderr


@pytest.fixture
def chromium() -> str:
    return _apt_install("chromium", "chromium")


@pytest.fixture
def tmux() -> str:
    return _apt_install("tmux", "tmux")


def _apt_install(package: str, binary: str) -> str:
    """The path of ``binary``, installing Debian's ``package`` if needed; skip the test with
    the reason when apt cannot get it."""
    found = shutil.which(binary)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"{binary} is not installed and apt-get cannot run here (not root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", package]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
        if done.returncode != 0:
            pytest.skip(f"apt-get could not install {package}: {done.stderr[-500:]}")
    found = shutil.which(binary)
    if not found:
        pytest.skip(f"apt-get installed {package} but {binary} is not on PATH")
    return found


@pytest.mark.slow
def test_the_status_page_renders_in_headless_chromium(chromium, long_job, tmp_path) -> None:
    proc, port, job, _ = long_job
    wait_for(
        "a committed step",
        lambda: scrape(port).get(("peerckpt_committed_step", ())) is not None,
        proc,
    )
    url = f"http://127.0.0.1:{port}/status"
    base = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={tmp_path}/profile",
    ]
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = _parse(dom.stdout)
    assert page.tables["summary"] and [r["rank"] for r in page.tables["ranks"]] == [
        "0",
        "1",
        "2",
        "3",
    ]
    assert f"<title>peerckpt · {job}</title>" in dom.stdout
    shot = tmp_path / "status.png"
    done = subprocess.run(
        [*base, "--window-size=1200,900", f"--screenshot={shot}", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    raw = shot.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(raw[16:20], "big") == 1200


@pytest.mark.slow
def test_the_live_status_view_in_a_real_terminal(tmux, long_job) -> None:
    proc, port, job, _ = long_job
    wait_for(
        "a committed step",
        lambda: scrape(port).get(("peerckpt_committed_step", ())) is not None,
        proc,
    )
    session = f"peerckpt-status-{os.getpid()}"
    cmd = f"{sys.executable} -m peerckpt.launch status --job {job} --interval 0.5"
    subprocess.run(
        [tmux, "new-session", "-d", "-s", session, "-x", "160", "-y", "50", "-c", str(REPO), cmd],
        check=True,
        timeout=30,
    )
    try:
        screens = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            screen = subprocess.run(
                [tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout
            if "committed step" in screen:
                screens.append(screen)
            if len(screens) >= 2 and screens[-1] != screens[0]:
                break  # it redrew with newer numbers
            time.sleep(0.5)
        assert screens, "the live view never showed the job"
        assert f"job {job}" in screens[-1] and "nodes" in screens[-1] and "ranks" in screens[-1]
        assert screens[-1] != screens[0], "the live view did not refresh"
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True, timeout=30)


def test_log_format_json_reaches_every_process_of_the_job(tmp_path) -> None:
    run = run_job(
        tmp_path / "job",
        script_args=["--steps", "3"],
        nodes=1,
        nproc=1,
        extra=["--log-format", "json"],
    )
    assert run.returncode == 0, run.log[-4000:]
    records = [json.loads(line) for line in run.log.splitlines() if line.startswith("{")]
    kinds = {r["process"].split()[0] for r in records}
    assert {"launcher", "coordinator", "agent", "rank"} <= kinds, kinds
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any("rank" in r and "epoch" in r for r in records if r["process"] == "rank")
    assert not [line for line in run.log.splitlines() if " peerckpt[" in line], "a human line"
