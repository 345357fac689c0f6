"""Training stall: what snapshotting every step costs a CPU training loop.

    python bench/stall.py [--sizes 64,256,1024] [--runs 5] [--step-ms 200] [--quick]
                          [--budget-only]

The loop (``bench/jobs/train_job.py``): an MLP whose parameters and AdamW state hold the
state size per rank, fused AdamW, one thread, the batch chosen so that a step takes about
``--step-ms`` where the state allows it (the optimizer and the weight gradients of a 1 GiB
state take longer than that on their own here: its step is what it is, and the JSON says so).

Each run is one ``peerckpt run`` job whose ranks first train ``--plain-steps`` steps with
nothing tracked (the baseline: no snapshot, in the same processes, at the same moment), then
``--steps`` steps of ``ctx.steps`` with a snapshot after every step. Two topologies:

* ``replicated`` (the figure): 2 nodes × 1 rank, one buddy each (k = 1) — the whole
  system: snapshot copy, the agent's checksum, replication to the other node, commit;
* ``local``: 1 node × 1 rank (k = 0: nothing to replicate to) — the snapshot copy and
  the checksum alone, to tell the two costs apart.

Per run: the median step time of each phase after its warm-up steps (first touches, the
first snapshots into fresh slots); per size, the median over runs. ``stall_fraction`` =
(with snapshots − baseline) / baseline. ``blocked_s`` is the part the loop spent blocked in
the snapshot engine (waiting for the previous copy, which waits for the previous commit);
the rest of the extra time is the agents' work taking CPU from the ranks. The socket and
crc32c ceilings are measured in the same run.

Results: ``bench/results/stall.json``; key ``stall_fraction`` per size (replicated), each
topology's rows under ``replicated`` and ``local``; the overhead budget's rows
(``bench/budget.py``) under ``budget``. ``--budget-only`` measures those again into the
existing file.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "jobs"))
from budget import budget_runs
from common import (
    HEARTBEAT_TIMEOUT_S,
    background_load,
    bench_parser,
    crc32c_gbps,
    job_name,
    leftover_segments,
    run_peerckpt,
    runs_for,
    scratch_dir,
    socket_gbps,
    steady,
    target,
    write_result,
)

JOB = Path(__file__).resolve().parent / "jobs" / "train_job.py"
TOPOLOGIES = {"replicated": 2, "local": 1}  # nodes (one rank each)
PLAIN_WARMUP, SNAPSHOT_WARMUP = 2, 4


def calibrate(mib: int, step_s: float) -> tuple[int, float]:
    """The batch at which a step of the ``mib`` model takes about ``step_s`` (one thread),
    and the step time at batch 1 (optimizer and weight gradients: the floor)."""
    import train_job

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = train_job.build(mib)
        optim = train_job.optimizer(model)
        hidden = model[0].in_features

        def step_time(batch: int) -> float:
            x = torch.randn(batch, hidden)
            train_job.train_step(model, optim, x)
            start = time.perf_counter()
            for _ in range(3):
                train_job.train_step(model, optim, x)
            return (time.perf_counter() - start) / 3

        small, large = step_time(1), step_time(256)
        per_sample = max((large - small) / 255, 1e-6)
        return max(1, round((step_s - small) / per_sample)), small
    finally:
        torch.set_num_threads(threads)


def one_run(
    mib: int, batch: int, nodes: int, args: Any, base: Path, index: int
) -> dict[str, Any] | str:
    """One job; its baseline and snapshot step times. A failed job returns its log's tail."""
    out = base / f"{nodes}n-{mib}-{index}"
    out.mkdir(parents=True)
    job = job_name("benchstall")
    argv = ["--nodes", str(nodes), "--nproc-per-node", "1", "--job", job]
    argv += ["--heartbeat-timeout", HEARTBEAT_TIMEOUT_S, str(JOB), str(out)]
    argv += ["--mib", str(mib), "--batch", str(batch)]
    argv += ["--steps", str(args.steps), "--plain-steps", str(args.plain_steps)]
    try:
        run_peerckpt(argv)
    except SystemExit as exc:
        return str(exc)[-1500:]
    finally:
        left = leftover_segments(job)
        if left:
            print(f"  removed {len(left)} segments the job left behind", flush=True)
    ranks = [json.loads((out / f"steps-peerckpt-rank{r}.json").read_text()) for r in range(nodes)]

    def per_step(probes: list[list[float]], column: int, skip: int) -> float:
        values = [b[column] - a[column] for a, b in itertools.pairwise(probes)]
        return steady(values, skip)

    return {
        "plain_s": statistics.median(steady(r["plain_times"], PLAIN_WARMUP) for r in ranks),
        "snapshot_s": statistics.median(steady(r["times"], SNAPSHOT_WARMUP) for r in ranks),
        "blocked_s": statistics.median(per_step(r["probes"], 0, SNAPSHOT_WARMUP) for r in ranks),
        # CPU seconds per step: of a rank process (training + its snapshot copy thread), and
        # of all agents together (checksums, replication), without and with snapshots.
        "rank_cpu_s": [
            statistics.median(per_step(r["plain_probes"], 1, PLAIN_WARMUP) for r in ranks),
            statistics.median(per_step(r["probes"], 1, SNAPSHOT_WARMUP) for r in ranks),
        ],
        "agents_cpu_s": [
            per_step(ranks[0]["plain_probes"], 2, PLAIN_WARMUP),
            per_step(ranks[0]["probes"], 2, SNAPSHOT_WARMUP),
        ],
        "state_bytes": ranks[0]["state_bytes"],
    }


def measure(mib: int, batch: int, nodes: int, runs: int, args: Any, base: Path) -> dict:
    done: list[dict[str, Any]] = []
    failures: list[str] = []
    index = 0
    while len(done) < runs and len(failures) <= runs // 2:
        got = one_run(mib, batch, nodes, args, base, index)
        index += 1
        if isinstance(got, str):
            failures.append(got)
            print(f"  run failed (kept in the JSON): {got.splitlines()[-1][:200]}", flush=True)
            continue
        done.append(got)
        print(
            f"  run {len(done)}: {got['plain_s'] * 1e3:.0f} ms → {got['snapshot_s'] * 1e3:.0f} ms "
            f"(blocked {got['blocked_s'] * 1e3:.1f} ms; CPU per step: rank "
            f"{got['rank_cpu_s'][0] * 1e3:.0f} → {got['rank_cpu_s'][1] * 1e3:.0f} ms, agents "
            f"{got['agents_cpu_s'][0] * 1e3:.0f} → {got['agents_cpu_s'][1] * 1e3:.0f} ms)",
            flush=True,
        )
    if not done:
        return {"failed_runs": failures, "stall_fraction": None}
    plain = statistics.median(r["plain_s"] for r in done)
    snap = statistics.median(r["snapshot_s"] for r in done)
    state_bytes = done[0]["state_bytes"]
    return {
        "ranks": nodes,
        "replicas": nodes - 1,
        "state_bytes": state_bytes,
        "batch": batch,
        "step_s_plain": plain,
        "step_s_peerckpt": snap,
        "stall_fraction": (snap - plain) / plain,
        "blocked_s": statistics.median(r["blocked_s"] for r in done),
        "cpu_per_step": {
            "rank_plain_s": statistics.median(r["rank_cpu_s"][0] for r in done),
            "rank_snapshot_s": statistics.median(r["rank_cpu_s"][1] for r in done),
            "agents_plain_s": statistics.median(r["agents_cpu_s"][0] for r in done),
            "agents_snapshot_s": statistics.median(r["agents_cpu_s"][1] for r in done),
        },
        "stall_fraction_runs": [(r["snapshot_s"] - r["plain_s"]) / r["plain_s"] for r in done],
        "snapshot_gbps_needed": nodes * state_bytes / plain / 1e9,
        "runs": len(done),
        "runs_plain": [r["plain_s"] for r in done],
        "runs_peerckpt": [r["snapshot_s"] for r in done],
        "failed_runs": failures,
    }


def reason(row: dict[str, Any], local: dict[str, Any] | None, ceilings: dict[str, float]) -> str:
    """Where the extra time per step goes, from what this run measured."""
    extra = row["step_s_peerckpt"] - row["step_s_plain"]
    blocked = row["blocked_s"]
    needed = row["snapshot_gbps_needed"]
    cpu = row["cpu_per_step"]
    agents = cpu["agents_snapshot_s"] - cpu["agents_plain_s"]
    copy = cpu["rank_snapshot_s"] - cpu["rank_plain_s"]
    text = (
        f"{extra * 1e3:.0f} ms more per step, of which the loop was blocked "
        f"{blocked * 1e3:.0f} ms in the snapshot engine (the copy of step s waits for the "
        f"commit of s−1, which waits for the checksum and the replication) and "
        f"{max(extra - blocked, 0) * 1e3:.0f} ms is the ranks computing slower: per step the "
        f"agents used {agents * 1e3:.0f} ms more CPU (checksums, sending and receiving "
        f"{row['ranks']} × {row['state_bytes'] / 2**20:.0f} MiB) and each rank process "
        f"{copy * 1e3:+.0f} ms (its snapshot copy), on a machine whose "
        f"{ceilings['cores']} cores the {row['ranks']} ranks already keep busy. Every step "
        f"asks the agents to checksum and send {needed:.2f} GB/s (loopback socket "
        f"{ceilings['socket_gbps']:.2f} GB/s, crc32c {ceilings['crc32c_gbps']:.1f} GB/s on one "
        f"core, measured in this run)"
    )
    if local and local.get("stall_fraction") is not None:
        text += (
            f"; without replication (1 node, {local['runs']} run(s), a profile) the same "
            f"state cost {local['stall_fraction']:+.1%} per step"
        )
    return text


def budget(result: dict[str, Any], sizes: list[int], step_ms: float) -> None:
    """The overhead budget's rows (``bench/budget.py``) and targets, into ``result``: for
    the sizes up to 256 MiB."""
    result["budget"] = {}
    with scratch_dir("budget") as scratch:
        for mib in [m for m in sizes if m <= 256]:
            batch, _ = calibrate(mib, step_ms / 1000)
            print(f"{mib} MiB with resilient(overhead=0.05)", flush=True)
            row = budget_runs(mib, batch, Path(scratch))
            print(
                f"  every {row['every']} step(s): {row['step_s_plain'] * 1e3:.0f} ms → "
                f"{row['step_s_budget'] * 1e3:.0f} ms ({row['stall_fraction']:+.1%}; the plain "
                f"step drifted {row['plain_drift']:+.1%} from before to after)",
                flush=True,
            )
            result["budget"][f"{mib}MiB"] = row
            t = target(row["stall_fraction"], row["overhead"], "at most")
            if not t["met"]:
                t["reason"] = (
                    f"n = {row['every']} chosen from {row['choices']}; the mean step over "
                    f"{row['measured_steps']} steps after the choice ({row['intervals']} whole "
                    f"interval(s)) includes {row['intervals']} snapshot(s); the "
                    f"plain steps before and after it differ by {row['plain_drift']:+.1%} "
                    f"(mean of {len(row['runs'])} run(s): "
                    f"{', '.join(format(r['stall_fraction'], '+.1%') for r in row['runs'])})"
                )
            result.setdefault("targets", {})[f"budget_stall_{mib}MiB"] = t


def budget_only(sizes: list[int], step_ms: float) -> None:
    """``--budget-only``: measure the budget's rows again into the existing stall.json (its
    other figures and their date kept; ``budget_measured_at`` says when)."""
    path = Path(__file__).resolve().parent / "results" / "stall.json"
    result = json.loads(path.read_text())
    budget(result, sizes, step_ms)
    result["budget_measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    result["budget_background_load"] = background_load()
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"updated the budget rows of {path}")


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--sizes", default="64,256,1024", help="MiB of state per rank")
    parser.add_argument("--steps", type=int, default=7, help="steps with a snapshot each")
    parser.add_argument("--plain-steps", type=int, default=4, help="baseline steps first")
    parser.add_argument("--step-ms", type=float, default=200.0)
    parser.add_argument(
        "--local-runs", type=int, default=1, help="runs of the 1-node topology (a profile)"
    )
    parser.add_argument(
        "--budget-only",
        action="store_true",
        help="only the overhead budget's rows, into stall.json",
    )
    args = parser.parse_args()
    sizes = [64] if args.quick else [int(x) for x in args.sizes.split(",")]
    if args.budget_only:
        budget_only(sizes, args.step_ms)
        return
    runs = 2 if args.quick else args.runs
    local_runs = 1 if args.quick else args.local_runs
    if args.quick:
        args.steps, args.plain_steps = 8, 4
    load = background_load()
    print(f"background load before starting: {load}", flush=True)
    ceilings: dict[str, Any] = {
        "socket_gbps": socket_gbps(256 << 20, runs=3),
        "crc32c_gbps": crc32c_gbps(256 << 20, runs=3),
        "cores": os.cpu_count(),
    }
    print(f"ceilings: {ceilings}", flush=True)
    result: dict[str, Any] = {
        "quick": args.quick,
        "step_ms_target": args.step_ms,
        "large_runs": args.large_runs,  # at 1 GiB and more (None: as many as runs)
        "steps": args.steps,
        "plain_steps": args.plain_steps,
        "warmup_steps": {"plain": PLAIN_WARMUP, "snapshot": SNAPSHOT_WARMUP},
        "heartbeat_timeout_s": float(HEARTBEAT_TIMEOUT_S),
        "ceilings": ceilings,
        "replicated": {},
        "local": {},
    }
    if local_runs < 5:
        result["local_runs_note"] = (
            f"the 1-node topology is a profile (what the snapshot copy costs without "
            f"replication): {local_runs} runs, to keep `make bench` under 25 minutes"
        )
    with scratch_dir("stall") as scratch:
        base = Path(scratch)
        for mib in sizes:
            batch, floor_s = calibrate(mib, args.step_ms / 1000)
            print(f"{mib} MiB: batch {batch} (batch 1 takes {floor_s * 1e3:.0f} ms)", flush=True)
            for name, nodes in TOPOLOGIES.items():
                print(f" {name} ({nodes} node(s) × 1 rank)", flush=True)
                n = runs_for(mib, runs if name == "replicated" else local_runs, args)
                row = measure(mib, batch, nodes, n, args, base)
                row["step_s_batch1_alone"] = floor_s
                result[name][f"{mib}MiB"] = row
    result["stall_fraction"] = {k: v["stall_fraction"] for k, v in result["replicated"].items()}
    result["targets"] = {}
    for key, row in result["replicated"].items():
        t = target(row["stall_fraction"], 0.01, "lower")
        if row["stall_fraction"] is None:
            t["reason"] = "every run failed: " + row["failed_runs"][-1][-300:]
        elif not t["met"]:
            t["reason"] = reason(row, result["local"].get(key), ceilings)
        result["targets"][f"stall_fraction_{key}"] = t
    budget(result, sizes, args.step_ms)
    path = write_result("stall", result)
    print()
    print(
        f"{'state':>8} {'topology':>11} {'plain ms':>9} {'snap ms':>9} {'stall':>8} {'blocked':>8}"
    )
    for name in TOPOLOGIES:
        for key, row in result[name].items():
            if row["stall_fraction"] is None:
                print(f"{key:>8} {name:>11}   every run failed")
                continue
            print(
                f"{key:>8} {name:>11} {row['step_s_plain'] * 1e3:9.1f} "
                f"{row['step_s_peerckpt'] * 1e3:9.1f} {row['stall_fraction']:+8.1%} "
                f"{row['blocked_s'] * 1e3:8.1f}"
            )
    print(f"written {path}")


if __name__ == "__main__":
    main()
