"""Jobs on a real Ray cluster on this machine: ``peerckpt run --ray ADDRESS``.

Each test starts a ``ray.cluster_utils.Cluster`` of its own: the head on 127.0.0.1 and every
worker node on its own loopback address (127.0.0.2, …), small object stores, one CPU each.
Host k of the job is the k-th Ray node (head first), its agent bound to that address. A Ray
node removed (``Cluster.remove_node``: its raylet and its workers killed) is a lost machine;
results are compared bit for bit with the local launcher's fault-free run of the same job.
The cluster is shut down whatever happens, and nothing of it may outlive the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from .conftest import JOBS, REPO, JobRun, job_name, read_jsonl
from .test_campaign import _campaign
from .test_hosts import _assert_bit_exact
from .test_reshard_jobs import _assert_ddp_restores_match

cluster_utils = pytest.importorskip("ray.cluster_utils")

DEADLINE_S = 240.0
NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
# The driver's address for a head on 127.0.0.1 stays loopback (Ray otherwise rewrites
# 127.0.0.1 to the machine's routable address, where this cluster does not listen).
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DEDUP_LOGS": "0"}


class RayCluster:
    """A Ray cluster of loopback nodes: ``nodes[0]`` the head (127.0.0.1), then 127.0.0.2, …"""

    def __init__(self, workers: int) -> None:
        self.cluster = cluster_utils.Cluster(
            initialize_head=True,
            head_node_args={"node_ip_address": "127.0.0.1", "include_dashboard": False, **NODE},
        )
        self.nodes = [self.cluster.head_node]
        for _ in range(workers):
            self.add()
        self.cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add(self) -> Any:
        addr = f"127.0.0.{len(self.nodes) + 1}"
        node = self.cluster.add_node(node_ip_address=addr, **NODE)
        self.nodes.append(node)
        return node

    def remove(self, index: int) -> None:
        """Lose Ray node ``index`` as a machine failure would (its raylet, its workers)."""
        self.cluster.remove_node(self.nodes[index], allow_graceful=False)

    def shutdown(self) -> None:
        """Stop every process of the cluster, then remove its session's logs and sockets."""
        session = self.cluster.head_node.get_session_dir_path()
        self.cluster.shutdown()
        shutil.rmtree(session, ignore_errors=True)


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A factory of Ray clusters, each shut down at the end; then no process started by this
    test (raylets, workers, actors, job processes) may be left."""
    for key, value in RAY_ENV.items():
        monkeypatch.setenv(key, value)
    made: list[RayCluster] = []

    def make(workers: int) -> RayCluster:
        made.append(RayCluster(workers))
        return made[-1]

    yield make
    for cluster in made:
        cluster.shutdown()
    deadline = time.monotonic() + 15.0
    left = psutil.Process().children(recursive=True)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    assert not left, f"processes left by the Ray cluster: {[p.pid for p in left]}"


class RayJob:
    """``peerckpt run --ray`` on the DDP job, its output read as it comes."""

    def __init__(
        self,
        out: Path,
        address: str,
        *flags: str,
        steps: int = 30,
        sleep: float = 0.0,
        script_args: tuple[str, ...] = (),
    ) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        argv = [
            sys.executable,
            "-m",
            "peerckpt.launch",
            "run",
            "--ray",
            address,
            "--nproc-per-node",
            "2",
            "--job",
            job_name(),
            "--report",
            str(out / "report.json"),
            *flags,
            str(JOBS / "ddp_job.py"),
            str(out),
            "--steps",
            str(steps),
            "--sleep",
            str(sleep),
            *script_args,
        ]
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=dict(os.environ, PEERCKPT_LOG_LEVEL="INFO"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, name="test-ray-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, what: str, rank: int = 0, step: int = 0) -> None:
        """Until a driver line contains ``what`` or rank ``rank`` recorded ``step`` steps."""
        deadline = time.monotonic() + DEADLINE_S
        progress = self.out / f"rank{rank}.jsonl"
        while time.monotonic() < deadline and self.proc.poll() is None:
            if what and any(what in line for line in list(self.lines)):
                return
            if step and progress.exists() and len(progress.read_text().splitlines()) >= step:
                return
            time.sleep(0.05)
        pytest.fail(f"never saw {what or f'step {step}'}; log tail:\n{self.log[-4000:]}")

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def finish(self) -> JobRun:
        try:
            self.proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGINT)  # the driver stops every host on Ctrl-C
            self.proc.wait(timeout=90)
            pytest.fail(f"the job did not end in {DEADLINE_S} s; log tail:\n{self.log[-4000:]}")
        finally:
            self._reader.join(timeout=10)
        path = self.out / "report.json"
        report = json.loads(path.read_text()) if path.exists() else {}
        return JobRun(self.proc.returncode, report, self.out, self.log)


def _replaced_from_peers(run: JobRun, spare_node: int) -> None:
    """Ranks 2 and 3 (node 1) went to the spare node, pulling from node 0's memory; ranks 0
    and 1 restored from their own node."""
    (event,) = run.report["events"]
    assert event["kind"] == "node" and event["ranks"] == [2, 3], event
    pulls = {p["rank"]: p for p in event["pulls"]}
    for rank in (2, 3):
        assert pulls[rank]["node"] == spare_node and pulls[rank]["source"] == 0
        assert pulls[rank]["bytes"] > 0
    for rank in (0, 1):
        assert pulls[rank]["source"] == pulls[rank]["node"] == 0 and pulls[rank]["bytes"] == 0


def test_a_removed_ray_node_is_replaced_by_a_spare_node(
    tmp_path, ray_cluster, reference_run
) -> None:
    """Three Ray nodes: hosts 0 and 1 hold two ranks each, host 2 is a spare node. Ray node 1
    is removed at step 12: its actor, launcher, agent and ranks die with it; host 2's spares
    take ranks 2 and 3 from node 0's memory, bit for bit."""
    cluster = ray_cluster(2)
    job = RayJob(tmp_path, cluster.address, "--nodes", "2", "--spares", "1")
    job.wait_for("", rank=2, step=12)
    cluster.remove(1)
    run = job.finish()
    assert run.returncode == 0, run.log[-6000:]
    _assert_bit_exact(run, reference_run)
    _replaced_from_peers(run, spare_node=2)
    assert "host 1 is lost with its Ray node" in run.log


@pytest.mark.slow
def test_a_rank_killed_under_ray_is_replaced_by_a_spare(
    tmp_path, ray_cluster, reference_run
) -> None:
    """``--chaos 'kill rank=2 at=10'``: the host of rank 2 kills it; a spare on the spare
    node takes it from its buddy's memory."""
    cluster = ray_cluster(2)
    job = RayJob(
        tmp_path, cluster.address, "--nodes", "2", "--spares", "1", "--chaos", "kill rank=2 at=10"
    )
    run = job.finish()
    assert run.returncode == 0, run.log[-6000:]
    _assert_bit_exact(run, reference_run)
    (event,) = run.report["events"]
    assert event["ranks"] == [2]
    pulls = {p["rank"]: p for p in event["pulls"]}
    assert pulls[2]["node"] == 2 and pulls[2]["source"] not in (1, 2) and pulls[2]["bytes"] > 0


@pytest.mark.slow
def test_kill_node_chaos_removes_the_ray_node(tmp_path, ray_cluster, reference_run) -> None:
    """``--chaos 'kill node=1 at=12'`` from the driver: host 1's actor kills its job
    processes and its raylet, as on a real cluster; the spare node takes over."""
    cluster = ray_cluster(2)
    job = RayJob(
        tmp_path, cluster.address, "--nodes", "2", "--spares", "1", "--chaos", "kill node=1 at=12"
    )
    run = job.finish()
    assert run.returncode == 0, run.log[-6000:]
    _assert_bit_exact(run, reference_run)
    _replaced_from_peers(run, spare_node=2)
    raylet = cluster.nodes[1].all_processes["raylet"][0].process
    assert raylet.poll() is not None, "the raylet of the removed node still runs"


@pytest.mark.slow
def test_a_removed_ray_node_without_spares_shrinks_the_world(tmp_path, ray_cluster) -> None:
    """Two Ray nodes, no spare, ``--min-nodes 1``: Ray node 1 removed at step 6; ranks 0 and 1
    go on as a world of two, restored from their own memory."""
    cluster = ray_cluster(1)
    job = RayJob(tmp_path, cluster.address, "--nodes", "2", "--min-nodes", "1", steps=20)
    job.wait_for("", rank=2, step=6)
    cluster.remove(1)
    run = job.finish()
    assert run.returncode == 0, run.log[-6000:]
    _assert_ddp_restores_match(tmp_path, world=2, log=run.log)
    (event,) = run.report["events"]
    assert event["mode"] == "reshard" and event["shrunk_to"] == 2


@pytest.mark.slow
def test_a_ray_node_that_joins_becomes_a_spare_node(tmp_path, ray_cluster, reference_run) -> None:
    """Two Ray nodes, ``--spares 1`` but no node for it: a third Ray node joins the cluster
    during the job and becomes the spare node; then Ray node 1 is removed and its spares
    take ranks 2 and 3, bit for bit."""
    cluster = ray_cluster(1)
    # A pause after each step (numerics unchanged) leaves time for the node to join.
    job = RayJob(tmp_path, cluster.address, "--nodes", "2", "--spares", "1", sleep=0.5)
    job.wait_for("", rank=2, step=3)
    cluster.add()
    job.wait_for("holds 2 spares")
    steps = len(read_jsonl(tmp_path / "rank2.jsonl"))
    assert steps < 30, "the job ended before the new node joined; make it longer"
    cluster.remove(1)
    run = job.finish()
    assert run.returncode == 0, run.log[-6000:]
    _assert_bit_exact(run, reference_run)
    _replaced_from_peers(run, spare_node=2)
    assert "joins as spare host 2" in run.log


@pytest.mark.slow
def test_add_node_chaos_grows_the_job_onto_a_free_ray_node(tmp_path, ray_cluster) -> None:
    """One Ray node holds the job's two ranks; ``--chaos 'add node at=5'`` starts a host on
    the other Ray node that joins with two more: every rank of the world of four restores
    the committed step, the newcomers from node 0's memory."""
    cluster = ray_cluster(1)
    job = RayJob(
        tmp_path,
        cluster.address,
        "--nodes",
        "1",
        "--chaos",
        "add node at=5",
        steps=2000,
        sleep=0.02,
        script_args=("--until-world", "4"),
    )
    run = job.finish()
    assert run.returncode == 0, run.log[-6000:]
    _assert_ddp_restores_match(tmp_path, world=4, log=run.log)
    (event,) = run.report["events"]
    assert event["kind"] == "grow" and event["grown_to"] == 4
    newcomers = [p for p in event["pulls"] if p["rank"] >= 2]
    assert newcomers and all(p["source"] == 0 and p["bytes"] > 0 for p in newcomers)
    assert "(joiner, 127.0.0.2)" in run.log


@pytest.mark.slow
def test_a_chaos_campaign_on_ray_ends_bit_exact(tmp_path, ray_cluster) -> None:
    """``peerckpt chaos --ray``: the reference and the chaos run on a 4-node Ray cluster (2
    nodes of ranks, 2 spare nodes); seed 1 kills rank 0, hangs rank 2 past the heartbeat,
    then node 1's agent. Every snapshot equals the reference's, every fault fired, and
    nothing of either job is left."""
    cluster = ray_cluster(3)
    shape = ("--nodes", "2", "--nproc-per-node", "2", "--spares", "2")
    report = _campaign(tmp_path, 1, 3, 30, "--ray", cluster.address, *shape)
    assert [r["fault"].split(" at=")[0] for r in report["rows"]] == [
        "kill rank=0",
        "hang rank=2",
        "kill agent node=1",
    ]
    assert sum(r["recovered_s"] is not None for r in report["rows"]) >= 2
    assert report["steps_compared"] >= 4 * 30


@pytest.mark.slow  # make test: tests/launch/test_raydriver.py (the environment sent to each node)
def test_the_launching_environment_reaches_the_ranks_on_every_ray_node(
    tmp_path, ray_cluster
) -> None:
    """A variable set only in the shell that runs ``peerckpt run --ray`` (not in the
    raylets' environment) is seen by the ranks on both Ray nodes; ``--env`` wins over the
    shell; a variable that names the launching machine (``DISPLAY``) stays the node's."""
    cluster = ray_cluster(1)
    names = ["TEST_RAY_FROM_SHELL", "TEST_RAY_OVERRIDE", "DISPLAY"]
    shell = {
        "TEST_RAY_FROM_SHELL": "shell value",
        "TEST_RAY_OVERRIDE": "from the shell",
        "DISPLAY": "driver-only-display",
    }
    argv = [
        sys.executable,
        "-m",
        "peerckpt.launch",
        "run",
        "--ray",
        cluster.address,
        "--nodes",
        "2",
    ]
    argv += ["--env", "TEST_RAY_OVERRIDE=from --env", "--job", job_name()]
    proc = subprocess.Popen(
        [*argv, str(JOBS / "env_job.py"), str(tmp_path), *names],
        cwd=REPO,
        env=dict(os.environ, PEERCKPT_LOG_LEVEL="INFO", **shell),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # the driver stops every host on Ctrl-C
        log, _ = proc.communicate(timeout=90)
        pytest.fail(f"the job did not end in {DEADLINE_S} s; log tail:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-6000:]
    seen = {r: json.loads((tmp_path / f"env{r}.json").read_text()) for r in (0, 1)}
    assert sorted(s["node"] for s in seen.values()) == [0, 1]  # one rank on each Ray node
    for record in seen.values():
        values = record["values"]
        assert values["TEST_RAY_FROM_SHELL"] == "shell value", record
        assert values["TEST_RAY_OVERRIDE"] == "from --env", record
        assert values["DISPLAY"] == os.environ.get("DISPLAY"), record  # the node's own


@pytest.mark.slow  # make test: the removed-node Ray job; this one (17 s) in make test-all
def test_a_ray_job_waits_for_every_host_to_finish_the_script_and_judges_it(
    tmp_path, ray_cluster
) -> None:
    """Training succeeds; then rank 3, on host 1, fails in the script's code after the
    decorated function. The driver used to end on host 0's result alone ("succeeded"),
    stopping host 1 while its ranks ran that code."""
    cluster = ray_cluster(1)
    job = RayJob(
        tmp_path, cluster.address, "--nodes", "2", steps=4, script_args=("--fail-after", "3")
    )
    run = job.finish()
    assert run.returncode == 1, run.log[-4000:]
    assert run.report["state"] == "failed"
    assert run.report["reason"].startswith(
        "host 1: training succeeded, but the script failed after the decorated function "
        "returned: rank 3 (pid "
    ), run.report["reason"]
    assert "the evaluation after training failed" in run.log
