"""A lost node under Ray against the local launcher: kill → every rank stepping, same job.

    python bench/ray_recovery.py [--runs 3] [--quick]

(Not ``bench/ray.py``: this folder is first on ``sys.path``, and that name would hide Ray.)

The job: ``tests/jobs/ddp_job.py``, 30 steps, 2 nodes × 2 ranks and a spare node holding 2
spares; node 1 is lost at step 12 and the spares take its ranks from node 0's memory.

* **local** (``local_s``): ``peerckpt run --nodes 2 --spares 2 --chaos 'kill node=1 at=12'``:
  node 1's agent and ranks SIGKILLed on this machine.
* **Ray, kill node** (``ray_kill_node_s``): ``peerckpt run --ray`` on a 3-node
  ``ray.cluster_utils.Cluster`` (head 127.0.0.1, workers 127.0.0.2 and .3, each its own
  failure domain), ``--chaos 'kill node=1 at=12'``: host 1's actor SIGKILLs the job's
  processes on its node and the node's raylet.
* **Ray, node removed** (``ray_remove_node_s``): the same cluster and job, no chaos;
  ``Cluster.remove_node`` (no grace) when rank 2 has recorded 12 steps: Ray kills the
  raylet and its workers, and the host launcher, seeing its actor die, kills the rest.

Each figure: from the kill (the chaos record's ``fired_at``, or the call to ``remove_node``)
to every rank stepping again (the report's ``resumed_at``), with detection (→ the
coordinator's ``detected_at``) apart; the median of ``--runs``. A fresh cluster per Ray run.
The first Ray run also records where every process of the job ran (``placement``) and its
recovery as a timeline relative to the kill (``timeline``), for docs/ray.md. Results:
``bench/results/ray.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, background_load, bench_parser, job_name, leftover_segments, write_result

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # a head on 127.0.0.1 stays loopback
from ray.cluster_utils import Cluster

JOB = REPO / "tests" / "jobs" / "ddp_job.py"
NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
KILL_AT = 12


def _job(out: Path, name: str, flags: list[str], steps: int) -> subprocess.Popen[str]:
    out.mkdir(parents=True)
    argv = [sys.executable, "-m", "peerckpt.launch", "run", "--nproc-per-node", "2", "--job", name]
    argv += ["--report", str(out / "report.json"), *flags, str(JOB), str(out)]
    argv += ["--steps", str(steps)]
    env = dict(os.environ, PEERCKPT_LOG_LEVEL="INFO", RAY_DEDUP_LOGS="0")
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen[str], out: Path) -> tuple[dict[str, Any], str]:
    log, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"the job failed ({proc.returncode}):\n{log[-4000:]}")
    return json.loads((out / "report.json").read_text()), log


def _figures(report: dict[str, Any], log: str, killed_at: float | None = None) -> dict[str, float]:
    """Kill → every rank stepping: to the last recovery's resume (a rank stuck in the
    aborted epoch under load is restarted in place, a second recovery that finishes the
    first); detection: to the first one's."""
    events = report["events"]
    if not events or events[-1].get("resumed_at") is None:
        raise SystemExit(f"no finished recovery in the report {events}:\n{log[-4000:]}")
    if killed_at is None:
        killed_at = next(c["fired_at"] for c in report["chaos"] if c.get("fired_at"))
    return {
        "kill_to_stepping_s": round(events[-1]["resumed_at"] - killed_at, 3),
        "detection_s": round(events[0]["detected_at"] - killed_at, 3),
        "recoveries": len(events),
    }


def _wait_steps(out: Path, rank: int, steps: int, proc: subprocess.Popen[str]) -> None:
    progress = out / f"rank{rank}.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if progress.exists() and len(progress.read_text().splitlines()) >= steps:
            return
        time.sleep(0.02)
    raise SystemExit(f"rank {rank} never reached step {steps}")


def _cluster() -> tuple[Cluster, list[Any]]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"node_ip_address": "127.0.0.1", "include_dashboard": False, **NODE},
    )
    workers = [cluster.add_node(node_ip_address=f"127.0.0.{i}", **NODE) for i in (2, 3)]
    cluster.wait_for_nodes()
    return cluster, workers


def placement(job: str) -> list[dict[str, Any]]:
    """Every process of ``job`` on this machine: what it is, its pid, and the Ray node
    (raylet address) it runs under, found through its host launcher's actor."""
    rows = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get("PEERCKPT_JOB") != job:
                continue
            cmd = " ".join(proc.cmdline())
            actor = psutil.Process(int(env["PEERCKPT_RAY_ACTOR_PID"]))
            raylet = " ".join(actor.parent().cmdline())  # type: ignore[union-attr]
        except (psutil.Error, KeyError, ValueError, AttributeError):
            continue
        node = raylet.partition("--node_ip_address=")[2].split(" ")[0]
        if "peerckpt.launch.rayhost" in cmd:
            what = f"host launcher (actor pid {actor.pid}: {actor.name()})"
        elif "peerckpt.recovery.server" in cmd:
            what = "coordinator"
        elif "peerckpt.replication.agent" in cmd:
            what = "agent" + (" (spare node)" if "--spare-node" in cmd else "")
        elif env.get("PEERCKPT_ROLE") == "rank":
            what = f"rank {env.get('RANK')}"
        else:
            what = env.get("PEERCKPT_ROLE", "?")
        rows.append({"ray_node": node, "pid": proc.pid, "process": what})
    return sorted(rows, key=lambda r: (r["ray_node"], r["process"]))


def _timeline(report: dict[str, Any], log: str, killed_at: float) -> list[str]:
    """The recovery, relative to the kill: the report's moments and the driver's lines."""
    event = report["events"][-1]
    lines = [
        f"+{event['detected_at'] - killed_at:.3f} s  coordinator: node 1 lost ({event['reason']})",
        f"+{event['resumed_at'] - killed_at:.3f} s  every rank stepping again "
        f"(epoch {event['epoch']}, restored step {event['restore_step']})",
    ]
    for pull in sorted(event["pulls"], key=lambda p: p["rank"]):
        lines.append(
            f"         rank {pull['rank']} on node {pull['node']}: "
            + (
                f"{pull['bytes']:,} bytes from node {pull['source']}"
                if pull["bytes"]
                else "its own node's memory"
            )
        )
    return lines + [line for line in log.splitlines() if "lost" in line and "launcher]" in line]


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    runs = 1 if args.quick else args.runs
    background_load()
    local, ray_kill, ray_remove = [], [], []
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        for i in range(runs):
            out = Path(tmp) / f"local{i}"
            name = job_name("bray")
            flags = ["--nodes", "2", "--spares", "2", "--chaos", f"kill node=1 at={KILL_AT}"]
            report, log = _finish(_job(out, name, flags, 30), out)
            local.append(_figures(report, log))
            leftover_segments(name)
            for mode in ("kill", "remove"):
                cluster, workers = _cluster()
                try:
                    out = Path(tmp) / f"ray-{mode}{i}"
                    name = job_name("bray")
                    flags = ["--ray", str(cluster.address), "--nodes", "2", "--spares", "1"]
                    if mode == "kill":
                        flags += ["--chaos", f"kill node=1 at={KILL_AT}"]
                    proc = _job(out, name, flags, 30)
                    if mode == "remove":
                        _wait_steps(out, 2, KILL_AT, proc)
                        if i == 0:
                            extra["placement"] = placement(name)
                        killed_at = time.time()
                        cluster.remove_node(workers[0], allow_graceful=False)
                        report, log = _finish(proc, out)
                        ray_remove.append(_figures(report, log, killed_at))
                        if i == 0:
                            extra["timeline"] = _timeline(report, log, killed_at)
                    else:
                        report, log = _finish(proc, out)
                        ray_kill.append(_figures(report, log))
                finally:
                    cluster.shutdown()
                leftover_segments(name)
            print(f"run {i}: local {local[-1]}, ray kill {ray_kill[-1]}, removed {ray_remove[-1]}")

    def median(rows: list[dict[str, float]], key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 3)

    result = {
        "quick": args.quick,
        "runs": runs,
        "job": "tests/jobs/ddp_job.py, 2 nodes × 2 ranks + a spare node, node 1 lost at step 12",
        "local_s": median(local, "kill_to_stepping_s"),
        "ray_kill_node_s": median(ray_kill, "kill_to_stepping_s"),
        "ray_remove_node_s": median(ray_remove, "kill_to_stepping_s"),
        "detection_s": {
            "local": median(local, "detection_s"),
            "ray_kill_node": median(ray_kill, "detection_s"),
            "ray_remove_node": median(ray_remove, "detection_s"),
        },
        "every_run": {"local": local, "ray_kill_node": ray_kill, "ray_remove_node": ray_remove},
        **extra,
    }
    path = write_result("ray", result)
    for row in extra.get("placement", []):
        print(f"{row['ray_node']:<11} {row['pid']:>7}  {row['process']}")
    print("\n".join(extra.get("timeline", [])))
    print(json.dumps({k: result[k] for k in ("local_s", "ray_kill_node_s", "ray_remove_node_s")}))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
