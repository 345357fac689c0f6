"""Reshard 4 → 2 ranks: from peer memory with peerckpt, and from local disk with DCP.

    python bench/reshard.py [--mib-per-rank 256] [--runs 3]

The same state, a model of float32 DTensor parameters sharded ``Shard(0)`` over 4 ranks
(1 GiB in total by default), is restored into ``Shard(0)`` over 2 ranks two ways, in one run:

* **peerckpt**: a real job, ``peerckpt run --nodes 4 --nproc-per-node 1 --replicas 2
  --min-nodes 2``, loses two of its four nodes at once; the two survivors rebuild the
  committed state from what is left in memory (their own snapshots and the replicas the lost
  ranks pushed to them or to each other, pulled over loopback TCP). Timed: ``ctx.track`` on
  the new world (wants, plan, transfers, copy into place; the slowest rank), and from the kill
  to every rank stepping again (from the job's report).
* **DCP**: 4 processes ``torch.distributed.checkpoint.save`` the same state to local disk;
  2 processes ``dcp.load`` it into the 2-rank layout. Timed between barriers; once with the
  files in the page cache (warm, as right after a save) and once after dropping them from
  it (cold, as on a restarted machine).

Every restore is checked element for element. Results: ``bench/results/reshard.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    disk_read_gbps,
    drop_page_cache,
    memcpy_gbps,
    run_peerckpt,
    scratch_dir,
    socket_gbps,
    write_result,
)
from jobs.state_layout import COLS, pattern, rows_per_tensor

JOB = Path(__file__).resolve().parent / "jobs" / "state_job.py"


# -- peerckpt -------------------------------------------------------------------------------
def peerckpt_run(args: argparse.Namespace, out: Path, index: int) -> dict[str, Any]:
    out.mkdir(parents=True)
    report = out / "report.json"
    argv = [
        "--nodes",
        "4",
        "--nproc-per-node",
        "1",
        "--replicas",
        "2",
        "--min-nodes",
        "2",
        "--job",
        f"benchreshard{os.getpid()}_{index}",
        "--chaos",
        f"kill node=2 at={args.kill_at}; kill node=3 at={args.kill_at}",
        "--report",
        str(report),
        str(JOB),
        str(out),
        "--mib-per-rank",
        str(args.mib_per_rank),
        "--tensors",
        str(args.tensors),
    ]
    proc = run_peerckpt(argv, log_level="INFO")
    lines = [json.loads(x) for x in (out / "restored.jsonl").read_text().splitlines()]
    final = [x for x in lines if x["world"] == 2 and x["epoch"] == max(y["epoch"] for y in lines)]
    # The ranks log their restore's two phases: planning and gathering (the agents' work),
    # and copying into place (the rank's).
    phases = [
        (float(m[1]), float(m[2]))
        for m in re.finditer(
            r"INFO restored .*\(world 2, was \d+\): ([\d.]+) s planning and gathering, "
            r"([\d.]+) s copying",
            proc.stdout + proc.stderr,
        )
    ]
    summary = json.loads(report.read_text())
    fired = min(c["fired_at"] for c in summary["chaos"])
    [last] = [e for e in summary["events"] if e.get("resumed_at")]
    pulls = last.get("pulls", [])
    return {
        "track_s": max(x["track_s"] for x in final),
        "kill_to_stepping_s": last["resumed_at"] - fired,
        "exact": all(x["exact"] for x in final) and len(final) == 2,
        "gather_s": max((g for g, _ in phases), default=None),
        "copy_into_place_s": max((c for _, c in phases), default=None),
        "restored_bytes": sum(x["nbytes"] for x in final),
        "bytes_from_own_node": sum(p["bytes"] for p in pulls if p["source"] == p["node"]),
        "bytes_over_tcp": sum(p["bytes"] for p in pulls if p["source"] != p["node"]),
    }


# -- DCP ------------------------------------------------------------------------------------
def _state(args: argparse.Namespace, world: int, rank: int, fill: bool) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", (world,))
    total_rows = rows_per_tensor(args)
    local_rows = total_rows // world
    state = {}
    for i in range(args.tensors):
        if fill:
            local = pattern(i, rank * local_rows, local_rows, total_rows)
        else:
            local = torch.empty(local_rows * COLS, dtype=torch.float32)
        state[f"model.w{i}"] = DTensor.from_local(
            local.view(local_rows, COLS), mesh, [Shard(0)], run_check=False
        )
    return state


def _dcp_worker(
    rank: int, world: int, port: int, phase: str, path: str, args: argparse.Namespace, q: Any
) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        if phase == "save":
            state = _state(args, world, rank, fill=True)
            dist.barrier()
            start = time.perf_counter()
            dcp.save(state, checkpoint_id=path)
            dist.barrier()
            q.put((rank, time.perf_counter() - start, True))
            return
        state = _state(args, world, rank, fill=False)
        if phase == "cold" and rank == 0:
            drop_page_cache(sorted(Path(path).iterdir()))
        dist.barrier()
        start = time.perf_counter()
        dcp.load(state, checkpoint_id=path)
        dist.barrier()
        seconds = time.perf_counter() - start
        total_rows = rows_per_tensor(args)
        local_rows = total_rows // world
        exact = all(
            torch.equal(
                state[f"model.w{i}"].to_local().reshape(-1).view(torch.int32),
                pattern(i, rank * local_rows, local_rows, total_rows).view(torch.int32),
            )
            for i in range(args.tensors)
        )
        q.put((rank, seconds, exact))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dcp_phase(args: argparse.Namespace, world: int, phase: str, path: Path) -> tuple[float, bool]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_dcp_worker, args=(r, world, port, phase, str(path), args, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if failed:
        raise SystemExit(f"DCP {phase} failed (exit codes {failed})")
    results = [q.get() for _ in range(world)]
    return max(r[1] for r in results), all(r[2] for r in results)


# -- the run --------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib-per-rank", type=int, default=256, help="state per old rank")
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3, help="repetitions of each measurement")
    parser.add_argument("--kill-at", type=int, default=4, help="step at which nodes 2, 3 die")
    parser.add_argument("--world", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    total = rows_per_tensor(args) * COLS * 4 * args.tensors
    print(f"state: {total / 2**30:.2f} GiB in {args.tensors} DTensors, Shard(0) over 4 → 2 ranks")

    ceilings = {"memcpy_gbps": memcpy_gbps(), "socket_gbps": socket_gbps()}
    print(
        f"ceilings: memcpy {ceilings['memcpy_gbps']:.1f} GB/s, loopback TCP "
        f"{ceilings['socket_gbps']:.1f} GB/s"
    )

    with scratch_dir("reshard") as scratch:
        base = Path(scratch)
        runs = []
        for i in range(args.runs):
            run = peerckpt_run(args, base / f"peerckpt{i}", i)
            print(
                f"peerckpt run {i}: track {run['track_s']:.3f} s (gather {run['gather_s']}, "
                f"copy into place {run['copy_into_place_s']}), kill → stepping "
                f"{run['kill_to_stepping_s']:.3f} s, exact {run['exact']}"
            )
            runs.append(run)

        path = base / "dcp"
        save_s, _ = dcp_phase(args, 4, "save", path)
        files = sorted(path.iterdir())
        ceilings["disk_read_gbps"] = disk_read_gbps(files)
        print(
            f"DCP save (4 ranks): {save_s:.2f} s; cold disk read {ceilings['disk_read_gbps']:.2f} GB/s"
        )
        warm, cold, exact = [], [], True
        for i in range(args.runs):
            for phase, into in (("warm", warm), ("cold", cold)):
                seconds, ok = dcp_phase(args, 2, phase, path)
                into.append(seconds)
                exact = exact and ok
                print(f"DCP load {phase} run {i}: {seconds:.3f} s, exact {ok}")

    peer_track = statistics.median(r["track_s"] for r in runs)
    peer_total = statistics.median(r["kill_to_stepping_s"] for r in runs)
    dcp_warm, dcp_cold = statistics.median(warm), statistics.median(cold)
    memcpy_s = total / (ceilings["memcpy_gbps"] * 1e9)
    result = {
        "state_bytes": total,
        "from_world": 4,
        "to_world": 2,
        "runs": args.runs,
        "ceilings": ceilings,
        "peerckpt_reshard_s": peer_track,
        "peerckpt_kill_to_stepping_s": peer_total,
        "peerckpt_runs": runs,
        "dcp_save_s": save_s,
        "dcp_load_warm_s": dcp_warm,
        "dcp_load_cold_s": dcp_cold,
        "dcp_load_warm_runs": warm,
        "dcp_load_cold_runs": cold,
        "dcp_exact": exact,
        "speedup_vs_dcp_warm": dcp_warm / peer_track,
        "speedup_vs_dcp_cold": dcp_cold / peer_track,
        "reshard_vs_memcpy": memcpy_s / peer_track,
    }
    path = write_result("reshard", result)
    print()
    print(f"{'':34}{'seconds':>10}{'vs peerckpt':>14}")
    print(f"{'peerckpt reshard from memory':34}{peer_track:10.3f}{1.0:14.2f}")
    print(f"{'DCP load, page cache warm':34}{dcp_warm:10.3f}{dcp_warm / peer_track:14.2f}")
    print(f"{'DCP load, page cache dropped':34}{dcp_cold:10.3f}{dcp_cold / peer_track:14.2f}")
    print(f"{'memcpy of the whole state':34}{memcpy_s:10.3f}{memcpy_s / peer_track:14.2f}")
    print(
        f"peerckpt kill → every rank stepping: {peer_total:.3f} s (detection, abort, new "
        "group, model build, reshard)"
    )
    ok = all(r["exact"] for r in runs) and exact
    print(f"every restore exact: {ok}; written {path}")
    if not ok:
        raise SystemExit("a restore was not exact")


if __name__ == "__main__":
    main()
