"""A 10,000-GPU job's control plane, simulated on this machine: plan, commits, rendezvous.

    python bench/scale.py [--parts plan,coordinator,rendezvous] [--quick]

Three costs that grow with the cluster, each measured at 100, 1,000 and 10,000 ranks (8 per
node) with the project's own code, the ranks and agents simulated (no torch in them):

- **plan** (``bench/scaleplan.py``): a resharding recovery of ``ranks`` × 1,000 tensors,
  end to end from the new ranks' ``Wants`` messages (msgpack bodies, as the RPC server gets
  them) to every node's reads; the held table was filled as the old ranks' layouts arrived
  (timed per layout);
- **coordinator** (``bench/coordinator.py``'s ``run``): one real coordinator process and
  simulated nodes committing a step a second over gRPC (each node's reports on its stream of
  calls); commit latency p99, the coordinator's CPU (cores) and peak memory;
- **rendezvous** (``bench/rdzvsim.py``): every rank of an epoch forming its process group
  against the coordinator's store (torch's TCPStore, libuv, bound as the coordinator binds
  it): the NCCL group and CPU gloo group a GPU job makes (``gpu``), NCCL alone, gloo eager
  (world² gets: measured where it is feasible) and the legacy TCPStore server beside libuv.

Results: ``bench/results/scale.json`` with ``date`` and ``targets``
(``plan_10k_end_to_end_s`` < 2, ``coordinator_commit_p99_1000x8_s`` < 1,
``rendezvous_10k_s`` < 5, each ``{value, target, met}``), the coordinator's CPU and
memory, and every size's figures. The simulated ranks and nodes share this machine's cores
with the coordinator and the store (on a cluster they are other machines), and other
people's work does too: the JSON has the load and each part's CPU time beside its wall time.
``--quick``: 100 and 1,000 ranks only, ``scale-quick.json`` (not a figure).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import coordinator as coordinator_bench
import rdzvsim
import scaleplan
from common import HEARTBEAT_TIMEOUT_S, background_load, others_cores, target, write_result

PER_NODE = 8
SIZES = (104, 1000, 10_000)  # ranks: 13, 125 and 1,250 nodes of 8
TENSORS = 1000
STORE_PROCS = 2  # processes of simulated ranks (the machine's cores)


def _in_child(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a fresh process (a clean heap per size), its result returned."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_run_child, args=(queue, fn, args))
    proc.start()
    try:
        ok, value = queue.get(timeout=1800)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    if not ok:
        raise SystemExit(f"{fn.__name__}{args} failed: {value}")
    return value


def _run_child(queue: Any, fn: Any, args: tuple[Any, ...]) -> None:
    try:
        queue.put((True, fn(*args)))
    except BaseException as exc:
        queue.put((False, f"{type(exc).__name__}: {exc}"))


def plan_part(sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    out = []
    for ranks in sizes:
        load = os.getloadavg()[0]
        result = _in_child(scaleplan.measure, ranks, TENSORS)
        result["loadavg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
        print(f"plan     {json.dumps(result)}", flush=True)
        out.append(result)
    return out


def coordinator_part(sizes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """``bench/coordinator.py``'s run at each (nodes, steps)."""
    out = []
    for nodes, steps in sizes:
        args = argparse.Namespace(
            nodes=nodes, ranks_per_node=PER_NODE, steps=steps, warmup=min(5, steps // 3),
            procs=1, heartbeat_timeout=float(HEARTBEAT_TIMEOUT_S), unbatched=False,
            unary=False, profile=False,
        )  # fmt: skip
        load = os.getloadavg()[0]
        r = coordinator_bench.run(args)
        r["loadavg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
        r.pop("profile", None)
        if r["commit_latency_s"]["p99"] is None:
            raise SystemExit(f"no step committed at {nodes} nodes: {json.dumps(r)[:2000]}")
        print(
            f"coordinator {nodes} nodes x {PER_NODE}: commit p50/p99 "
            f"{r['commit_latency_s']['p50']:.3f}/{r['commit_latency_s']['p99']:.3f} s, "
            f"CPU {r['coordinator_cpu_cores']:.2f} cores, peak {r['peak_rss_mib']:.0f} MiB, "
            f"joined in {r['join_s']:.1f} s",
            flush=True,
        )
        out.append(r)
    return out


def _store(queue: Any, libuv: bool) -> None:
    """The job's rendezvous store as the coordinator makes it (``recovery/server.py``: a
    socket bound to one address, handed over), libuv or torch's legacy server."""
    import torch.distributed as dist

    from peerckpt.storegate import bound_socket

    sock = bound_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False,
        master_listen_fd=sock.detach(), use_libuv=libuv,
    )  # fmt: skip
    queue.put((port, bool(getattr(store, "libuvBackend", libuv))))
    time.sleep(3600)


def _share(queue: Any, args: tuple[Any, ...]) -> None:
    queue.put(rdzvsim.simulate(*args))


def _rendezvous(port: int, world: int, pattern: str, store_pid: int, epoch: str) -> dict[str, Any]:
    import psutil

    ctx = mp.get_context("spawn")
    store = psutil.Process(store_pid)
    prefix = f"/peerckpt/scale/{epoch}/default_pg/"
    queue, ready = ctx.Queue(), ctx.Queue()
    goes = [ctx.Queue() for _ in range(STORE_PROCS)]
    shares = [list(range(world))[i::STORE_PROCS] for i in range(STORE_PROCS)]
    procs = [
        ctx.Process(target=_share, args=(queue, (share, world, pattern, port, prefix, ready, go)))
        for share, go in zip(shares, goes, strict=True)
    ]
    for p in procs:
        p.start()
    for _ in procs:  # every process of simulated ranks is ready: they start together
        ready.get(timeout=300)
    start_at = time.monotonic() + 0.2
    for go in goes:
        go.put(start_at)
    cpu0 = sum(store.cpu_times()[:2])
    results = [queue.get(timeout=900) for _ in procs]
    store_cpu = sum(store.cpu_times()[:2]) - cpu0
    for p in procs:
        p.join(30)
    done = sorted(d for r in results for d in r["done"])
    return {
        "world": world,
        "pattern": pattern,
        "rendezvous_s": round(done[-1], 3),
        "p50_s": round(statistics.median(done), 3),
        "store_cpu_s": round(store_cpu, 3),
        "simulated_ranks_cpu_s": round(sum(r["cpu_s"] for r in results), 3),
    }


def rendezvous_part(sizes: tuple[int, ...], quick: bool) -> dict[str, Any]:
    """The store's cost per pattern and size; libuv against the legacy server at the top."""
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"runs": []}
    top = sizes[-1]
    plan = [(True, w, "gpu") for w in sizes] + [(True, w, "nccl") for w in sizes]
    # Eager gloo is world² gets of O(world) bytes: 10^8 at 10,000 ranks (800 MB to each
    # rank), 266 s at 1,000 here; it is measured at 104 and 320 ranks.
    plan += [(True, w, "gloo") for w in (sizes[0], 320)]
    plan += [(False, top, "gpu")]
    for libuv in (True, False):
        queue = ctx.Queue()
        store = ctx.Process(target=_store, args=(queue, libuv), daemon=True)
        store.start()
        try:
            port, backend = queue.get(timeout=120)
            for i, (uv, world, pattern) in enumerate(plan):
                if uv != libuv:
                    continue
                load = os.getloadavg()[0]
                r = _rendezvous(port, world, pattern, store.pid or 0, f"epoch-{i}")
                r["store"] = "libuv" if backend else "legacy"
                r["loadavg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
                print(f"rendezvous {json.dumps(r)}", flush=True)
                out["runs"].append(r)
        finally:
            store.kill()
            store.join(10)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="plan,coordinator,rendezvous")
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 ranks only")
    args = parser.parse_args()
    load = background_load()
    print(f"machine load before: {load['cpu_percent_1s']:.0f}% CPU, loadavg {load['loadavg']}")
    sizes = SIZES[:2] if args.quick else SIZES
    parts = args.parts.split(",")
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "quick": args.quick}
    targets: dict[str, Any] = {}
    if "plan" in parts:
        result["plan"] = plan_part(sizes)
        top = result["plan"][-1]
        if top["ranks"] == 10_000:
            targets["plan_10k_end_to_end_s"] = target(top["end_to_end_s"], 2.0, "lower", " s")
            targets["plan_10k_end_to_end_s"]["cpu_s"] = top["end_to_end_cpu_s"]
    if "coordinator" in parts:
        nodes = [(s // PER_NODE, 12) for s in sizes[:-1]] + [(1000, 25)]
        if not args.quick:
            nodes.append((sizes[-1] // PER_NODE, 15))
        runs = coordinator_part(nodes)
        result["coordinator"] = runs
        at = next((r for r in runs if r["nodes"] == 1000), None)
        if at is not None:
            p99 = at["commit_latency_s"]["p99"]
            targets["coordinator_commit_p99_1000x8_s"] = target(p99, 1.0, "lower", " s")
            result["coordinator_cpu_cores_1000x8"] = at["coordinator_cpu_cores"]
            result["coordinator_peak_rss_mib_1000x8"] = at["peak_rss_mib"]
    if "rendezvous" in parts:
        result["rendezvous"] = rendezvous_part(sizes, args.quick)
        top = next(
            (
                r for r in result["rendezvous"]["runs"]
                if r["world"] == 10_000 and r["pattern"] == "gpu" and r["store"] == "libuv"
            ),
            None,
        )  # fmt: skip
        if top is not None:
            targets["rendezvous_10k_s"] = target(top["rendezvous_s"], 5.0, "lower", " s")
    others = others_cores()
    for name, t in targets.items():
        if t["met"] is False:
            t["reason"] = (
                f"other work kept {others:.2f} of {os.cpu_count()} cores busy on average "
                "(see background_load); each part's CPU time is beside its wall time"
            )
        print(f"{name}: {t['value']} ({t['target']}): {'met' if t['met'] else 'NOT met'}")
    result["targets"] = targets
    print(f"written {write_result('scale', result)}")


if __name__ == "__main__":
    main()
