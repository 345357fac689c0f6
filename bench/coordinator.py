"""One coordinator, 1,000 simulated nodes × 8 ranks committing a step every second.

    python bench/coordinator.py [--nodes 1000] [--ranks-per-node 8] [--steps 40]
                                [--procs 1] [--unbatched] [--unary] [--profile] [--quick]

The coordinator is the real one (``python -m peerckpt.recovery.server``, its own process);
the agents are simulated, many per process (``--procs`` processes, asyncio), but speak the
real protocol through ``peerckpt/rpc.py`` (``AsyncRpcClient``: the agents' messages,
authentication and errors on a ``grpc.aio`` channel, one channel and connection per node).
Each node registers, holds its ``Watch`` stream, reports its ranks (``ProcJoined``), waits
for epoch 0, then heart-beats as the agent does (every ``heartbeat_timeout / 5``, at most
0.5 s, skipped while a report younger than ``heartbeat_timeout / 5`` stands for one: the
default timeout is 30 s, as the other benchmarks' jobs) and, at every step (one a second,
all nodes at once, each node a few ms apart as snapshots finish), reports its ranks' replicated snapshots: as the agent sends them
(``CoordinatorLink.report_replicated``: the reports ready together travel as one
``ReplicatedMany`` on the node's stream of calls, ``peerckpt/rpcstream.py``), or one
``Replicated`` per rank (``--unbatched``), or each report and heart-beat as a gRPC call of
its own (``--unary``, as before the stream).

Measured over the steps after ``--warmup``: the coordinator's CPU (cores, from /proc) and
memory (RSS, peak); commit latency, from the last rank's report of a step (its call's start)
to each node seeing ``Commit`` on its stream (p50, p99, max over every node and step); the
steps committed; heartbeat round trips (p50, p99) and nodes wrongly declared lost; a
``Status`` call's time at this size. ``--profile`` samples the coordinator with py-spy
(if installed) and writes its top functions to the JSON. The simulated nodes are in
``bench/coordsim.py``. Results: ``bench/results/coordinator.json``
(``--quick``: 100 nodes, 10 steps, ``coordinator-quick.json``, not a figure).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    HEARTBEAT_TIMEOUT_S,
    REPO,
    background_load,
    bench_parser,
    job_name,
    others_cores,
    target,
    write_result,
)
from coordsim import simulate

from peerckpt.messages.control import (
    Status,
    Stop,
)
from peerckpt.rpc import RpcClient


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_mem(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return {"rss_mib": round(out["VmRSS"], 1), "peak_rss_mib": round(out["VmHWM"], 1)}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _start_coordinator(
    job: str, world: int, hb: float, secret: bytes
) -> tuple[subprocess.Popen[str], str]:
    argv = [
        sys.executable,
        "-m",
        "peerckpt.recovery.server",
        "--job",
        job,
        "--world-size",
        str(world),
        "--replicas",
        "1",
        "--heartbeat-timeout",
        str(hb),
    ]
    env = dict(os.environ, PEERCKPT_SECRET=secret.hex(), PEERCKPT_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY "):
            return proc, json.loads(line[6:])["address"]
    raise SystemExit(f"the coordinator exited ({proc.wait()}) before it was ready")


def _profile(pid: int, seconds: float) -> subprocess.Popen[bytes] | None:
    """py-spy sampling the coordinator (every thread) for ``seconds``, if it is installed."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return None
    out = Path(f"/tmp/coordinator-profile-{pid}.txt")
    return subprocess.Popen(
        [
            str(spy),
            "record",
            "-p",
            str(pid),
            "-d",
            str(int(seconds)),
            "-r",
            "200",
            "-f",
            "raw",
            "-o",
            str(out),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _top(pid: int, n: int = 25) -> dict[str, Any]:
    """The profile's functions by samples in them (self) and under them (total)."""
    path = Path(f"/tmp/coordinator-profile-{pid}.txt")
    if not path.exists():
        return {}
    own: dict[str, int] = {}
    under: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [
            f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].split(":")[0] for f in stack.split(";")
        ]
        k = int(count)
        total += k
        own[frames[-1]] = own.get(frames[-1], 0) + k
        for f in set(frames):
            under[f] = under.get(f, 0) + k
    path.unlink()

    def share(d: dict[str, int]) -> dict[str, float]:
        return {f: round(c / total, 3) for f, c in sorted(d.items(), key=lambda x: -x[1])[:n]}

    return {"samples": total, "self": share(own), "total": share(under)}


def run(args: Any) -> dict[str, Any]:
    nodes, per_node = args.nodes, args.ranks_per_node
    hb_interval = max(0.05, min(0.5, args.heartbeat_timeout / 5))  # the agent's
    secret, job = secrets.token_bytes(32), job_name("coord")
    coordinator, address = _start_coordinator(job, nodes * per_node, args.heartbeat_timeout, secret)
    ctx = mp.get_context("spawn")
    to_parent = ctx.Queue()
    starts = [ctx.Queue() for _ in range(args.procs)]
    sim_args = {
        "warmup": args.warmup,
        "steps": args.steps,
        "period": 1.0,
        "batched": not args.unbatched,
        "streamed": not args.unary,
        "heartbeat_interval": hb_interval,
        "heartbeat_timeout": args.heartbeat_timeout,
    }
    shares = [list(range(nodes))[i :: args.procs] for i in range(args.procs)]
    sims = [
        ctx.Process(
            target=simulate,
            args=(share, per_node, address, secret, job, sim_args, to_parent, start),
            daemon=True,
        )
        for share, start in zip(shares, starts, strict=True)
    ]
    began = time.monotonic()
    try:
        for p in sims:
            p.start()
        ready = 0
        while ready < nodes:
            _kind, count = to_parent.get(timeout=600)
            ready += count
        join_s = time.monotonic() - began
        status = RpcClient(address, secret, job)
        t0 = time.monotonic() + 1.0
        for q in starts:
            q.put(t0)
        warm_end = t0 + args.warmup
        time.sleep(max(0.0, warm_end - time.monotonic()))
        cpu0, w0 = _proc_cpu(coordinator.pid), time.monotonic()
        spy = _profile(coordinator.pid, args.steps - args.warmup - 1) if args.profile else None
        end = t0 + args.steps
        time.sleep(max(0.0, end - time.monotonic()))
        cpu_cores = (_proc_cpu(coordinator.pid) - cpu0) / (time.monotonic() - w0)
        mem = _proc_mem(coordinator.pid)
        status_s = []
        for _ in range(3):
            start = time.perf_counter()
            final = status.call(Status(), timeout=60.0)
            status_s.append(time.perf_counter() - start)
        results = [to_parent.get(timeout=120) for _ in sims]
        if spy is not None:
            spy.wait(60)
        status.call(Stop("the benchmark is over"))  # no node is lost as the nodes go
        status.close()
        for q in starts:
            q.put("end")
    finally:
        coordinator.send_signal(signal.SIGTERM)
        coordinator.wait(30)
        for p in sims:
            p.join(30)
            if p.is_alive():
                p.kill()
    sent: dict[int, float] = {}
    for _, r in results:
        for step, t in r["sent"].items():
            sent[step] = max(sent.get(step, 0.0), t)
    measured = [s for s in range(args.warmup, args.steps)]
    latencies, missing = [], 0
    for _, r in results:
        for commits in r["commits"].values():
            for step in measured:
                if step in commits:
                    latencies.append(commits[step] - sent[step])
                else:
                    missing += 1
    beats = [h for _, r in results for h in r["heartbeats"]]
    alive = sum(final.nodes.values())
    return {
        "nodes": nodes,
        "ranks_per_node": per_node,
        "ranks": nodes * per_node,
        "batched": not args.unbatched,
        "streamed": not args.unary,
        "steps_measured": len(measured),
        "join_s": round(join_s, 2),
        "coordinator_cpu_cores": round(cpu_cores, 3),
        **mem,
        "commit_latency_s": {
            "p50": _pct(latencies, 0.5),
            "p99": _pct(latencies, 0.99),
            "max": max(latencies) if latencies else None,
            "samples": len(latencies),
        },
        "commits_missing": missing,
        "reports_failed": sum(r["failed_reports"] for _, r in results),
        "committed_step": final.committed_step,
        "heartbeat_interval_s": hb_interval,
        # sent while the steps were measured (reports stand for most: the agent skips a beat
        # when a report is younger than heartbeat_timeout / 5)
        "heartbeats_per_s": round(len(beats) / (args.steps - args.warmup), 1),
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "heartbeat_rtt_s": {
            "p50": _pct(beats, 0.5),
            "p99": _pct(beats, 0.99),
            "max": max(beats, default=None),
            "count": len(beats),
        },
        "nodes_alive_at_end": alive,
        "heartbeats_failed": sum(r["failed_heartbeats"] for _, r in results),
        "heartbeat_errors": sorted({e for _, r in results for e in r["heartbeat_errors"]})[:5],
        # the longest a simulated node went between two heart-beats it sent (its process's
        # loop was busy or starved): over the timeout, it is declared lost whatever the server
        "heartbeat_max_gap_s": max(r["heartbeat_max_gap"] for _, r in results),
        "job_state_at_end": final.state.value,
        "status_call_s": round(statistics.median(status_s), 3),
        "simulator_cpu_cores": round(sum(r["cpu_s"] for _, r in results) / args.steps, 3),
        "profile": _top(coordinator.pid) if args.profile else {},
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--procs", type=int, default=1, help="processes of simulated nodes")
    # As the other benchmarks' jobs: on a shared machine a starved process of simulated nodes
    # must not be declared lost (the agent's heart-beat interval is 0.5 s all the same).
    parser.add_argument("--heartbeat-timeout", type=float, default=float(HEARTBEAT_TIMEOUT_S))
    parser.add_argument("--unbatched", action="store_true", help="one call per rank's report")
    parser.add_argument(
        "--unary", action="store_true", help="each report a call of its own, not on a stream"
    )
    parser.add_argument("--profile", action="store_true", help="py-spy the coordinator")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.steps, args.warmup, args.procs = min(args.nodes, 100), 10, 3, 2
    background_load()
    r = run(args)
    p99 = r["commit_latency_s"]["p99"]
    label = f"{r['nodes']}x{r['ranks_per_node']}"
    r["quick"] = args.quick
    r["targets"] = {
        f"coordinator_commit_p99_{label}": target(p99, 1.0, "lower", " s"),
        f"coordinator_cpu_{label}": target(r["coordinator_cpu_cores"], 1.0, "lower"),
    }
    others = others_cores()
    cores = os.cpu_count() or 1
    why = (
        f"on {cores} cores the coordinator used {r['coordinator_cpu_cores']:.2f}, the simulated "
        f"nodes {r['simulator_cpu_cores']:.2f} and other work {others:.2f} cores on average: "
        "every process of the run waited for a core (see the JSON's profile and "
        "docs/performance.md, “A cluster's size”)"
    )
    for t in r["targets"].values():
        if t["met"] is False:
            t["reason"] = why
    path = write_result("coordinator", r)
    print(json.dumps({k: v for k, v in r.items() if k != "profile"}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
