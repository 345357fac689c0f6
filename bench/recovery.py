"""Recovery of one lost rank: peerckpt against what a user can do today.

    python bench/recovery.py [--sizes 256,1024] [--runs 5] [--cost-runs 3] [--quick]

The state is ``bench/jobs/state_job.py``'s: frozen float32 DTensors, ``Shard(0)``, the given
MiB per rank, checked bit for bit after every restore. Per size, in one run:

* **peerckpt** (``peerckpt_s``): a real job, 4 ranks (``--nodes 2 --nproc-per-node 2
  --spares 1``, one buddy each) snapshotting every step; ``--chaos 'kill rank=2 at=2'``
  SIGKILLs a rank; a spare takes its place and its state comes from peer memory. Timed from
  the kill to every rank stepping again (the job's report), with the breakdown: detection
  (kill → the coordinator knows), membership (decision, abort, the new epoch's process group:
  what is left of the time to the replacement's function being called), transfer (the
  replacement's agent pulling the snapshot from a buddy), restore (the replacement's
  ``ctx.track``: the copy from its slot into the model, under cProfile) and resume (→ every
  rank reported its first step).
* **DCP restart** (``dcp_restart_s``): every rank restarted, as torchrun does: fresh
  processes import torch, join a new gloo group, build the model and ``dcp.load`` the same
  state from local disk (saved there just before: files in the page cache; with
  ``--cold-runs N``, N more with them dropped from it, ``dcp_restart_cold_s``), then step.
  Timed from spawning the processes to every rank stepping. Detection and stopping the old
  job are not included.
* **torchft** (``torchft_s``): torchft 0.2.0's transports heal the lost rank from a live
  peer: a restarted process imports torch and torchft, allocates the state, joins a
  2-process group with the peer and receives the state in place with ``PGTransport``; then
  fetches it once more with ``HTTPTransport`` (``torchft_http_s``, transfer only). Timed
  from spawning the process to the state received; torchft's quorum and manager are not
  included.

The restore's copy is also measured alone, in this process, with one thread as a rank has
(``copy_fresh_cpu_s``, ``copy_touched_cpu_s``: CPU seconds to copy a size's state from a
shared mapping into tensors just allocated, and again into the same tensors), so that the
restore's wall time can be read against the work it needs: every rank of the new epoch copies
its state at once, on the same cores.

A size whose 4-rank job does not fit in this machine's memory (ranks, two slots and two
replica slots per rank, the spare) runs with 2 ranks, and the JSON says so. The loopback
socket ceiling is measured in the same run. Results: ``bench/results/recovery.json``; keys
``peerckpt_s``, ``dcp_restart_s``, ``torchft_s``, ``speedup_vs_dcp`` per size, and every
size's runs and breakdowns.
"""

from __future__ import annotations

import json
import mmap
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cost
from common import (
    HEARTBEAT_TIMEOUT_S,
    background_load,
    bench_parser,
    drop_page_cache,
    job_name,
    leftover_segments,
    run_peerckpt,
    runs_for,
    scratch_dir,
    socket_gbps,
    target,
    write_result,
)

JOBS = Path(__file__).resolve().parent / "jobs"
KILL_AT = 2  # the kill fires once step 1 is committed: both slots of every rank are in use
REPLICAS = 1
PROCESS_GIB = 0.5  # a torch process's own memory, measured here: 0.35–0.45 GiB


def ranks_that_fit(mib: int) -> tuple[int, str]:
    """4 ranks if the job fits in the memory available now, else 2; and why."""
    available = psutil.virtual_memory().available / 2**30
    s = mib / 1024

    def need(world: int) -> float:
        # each rank: its model, 2 own slots, 2 replica slots per buddy; the spare: its model
        # and its 2 slots; every process's own memory; 1 GiB to spare.
        return world * s * (1 + 2 * (1 + REPLICAS)) + 3 * s + (world + 1) * PROCESS_GIB + 1

    if need(4) <= available:
        return 4, ""
    return 2, (
        f"4 ranks × {mib} MiB need ≈{need(4):.1f} GiB (each rank its model, 2 slots and 2 "
        f"replica slots, the spare, the processes), {available:.1f} GiB was available: "
        f"measured with 2 ranks (≈{need(2):.1f} GiB)"
    )


# -- peerckpt ---------------------------------------------------------------------------------
def peerckpt_run(mib: int, world: int, base: Path) -> dict[str, Any]:
    out = base / f"peerckpt-{mib}-{len(list(base.iterdir()))}"
    out.mkdir()
    job, victim = job_name("benchrec"), world - 2
    topology = ["--nodes", "2", "--nproc-per-node", str(world // 2), "--spares", "1"]
    try:
        run_peerckpt(
            [
                *topology,
                "--replicas",
                str(REPLICAS),
                "--heartbeat-timeout",
                HEARTBEAT_TIMEOUT_S,
                "--job",
                job,
                "--chaos",
                f"kill rank={victim} at={KILL_AT}",
                "--report",
                str(out / "report.json"),
                str(JOBS / "state_job.py"),
                str(out),
                "--mib-per-rank",
                str(mib),
                "--world",
                str(world),
                "--sleep",
                "0",
                "--steps",
                "40",
                "--after",
                "1",
                "--profile-restore",
            ]
        )
    finally:
        left = leftover_segments(job)
    report = json.loads((out / "report.json").read_text())
    [chaos] = report["chaos"]
    [event] = [e for e in report["events"] if e["kind"] == "rank"]
    lines = [json.loads(x) for x in (out / "restored.jsonl").read_text().splitlines()]
    mine = next(x for x in lines if x["rank"] == victim)
    [pull] = [p for p in event["pulls"] if p["rank"] == victim]
    fired, detected, resumed = chaos["fired_at"], event["detected_at"], event["resumed_at"]
    profile = (out / f"profile-e{mine['epoch']}-rank{victim}.txt").read_text()
    return {
        "peerckpt_s": resumed - fired,
        "breakdown": {
            "detection_s": detected - fired,
            "membership_s": mine["entered_at"] - detected - pull["seconds"],
            "transfer_s": pull["seconds"],
            "restore_s": mine["tracked_at"] - mine["entered_at"],
            "resume_s": resumed - mine["tracked_at"],
        },
        "waited_for_spares_s": event.get("waited_for_spares_s", 0.0),
        "transfer_bytes": pull["bytes"],
        "transfer_from": f"node {pull['source']} → node {pull['node']}",
        "survivors_restore_s": max(x["track_s"] for x in lines if x["rank"] != victim),
        "state_bytes_per_rank": mine["nbytes"],
        "exact": all(x["exact"] for x in lines) and len(lines) == world,
        "restore_profile": profile.splitlines()[:20],
        "leftover_segments": left,
    }


# -- the copy alone ----------------------------------------------------------------------------
def _cpu_and_faults() -> tuple[float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def copy_cost(mib: int, runs: int = 3) -> dict[str, float]:
    """CPU seconds (and page faults) to copy ``mib`` MiB from a shared mapping, as a slot is,
    into four tensors just allocated (as a rank restores into a model it just built) and again
    into the same, touched, tensors. One thread, as every rank runs. Medians of ``runs``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    nbytes = mib << 20
    shared = mmap.mmap(-1, nbytes, mmap.MAP_SHARED)
    try:
        slot = torch.frombuffer(shared, dtype=torch.uint8)
        slot.fill_(1)
        pieces = [p.view(torch.float32) for p in slot.chunk(4)]
        fresh, touched, faults = [], [], []
        for _ in range(runs):
            cpu0, faults0 = _cpu_and_faults()
            tensors = [torch.empty_like(p) for p in pieces]
            for t, p in zip(tensors, pieces, strict=True):
                t.copy_(p)
            cpu1, faults1 = _cpu_and_faults()
            for t, p in zip(tensors, pieces, strict=True):
                t.copy_(p)
            cpu2, _ = _cpu_and_faults()
            fresh.append(cpu1 - cpu0)
            touched.append(cpu2 - cpu1)
            faults.append(faults1 - faults0)
            del tensors
        del slot, pieces
    finally:
        shared.close()
        torch.set_num_threads(threads)
    return {
        "copy_fresh_cpu_s": statistics.median(fresh),
        "copy_fresh_page_faults": statistics.median(faults),
        "copy_touched_cpu_s": statistics.median(touched),
    }


# -- DCP --------------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dcp_ranks(phase: str, mib: int, world: int, ckpt: Path, out: Path) -> list[dict[str, Any]]:
    """Start ``world`` fresh processes of ``dcp_job.py``; their timing lines."""
    port = _free_port()
    spawned = time.time()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(JOBS / "dcp_job.py"),
                str(ckpt),
                str(out),
                "--phase",
                phase,
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--port",
                str(port),
                "--mib-per-rank",
                str(mib),
                "--spawned-at",
                repr(spawned),
            ],
            cwd=JOBS,
        )
        for rank in range(world)
    ]
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"DCP {phase} failed: exit codes {codes}")
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    out.unlink()
    return lines


def dcp_restart(mib: int, world: int, ckpt: Path, base: Path, cold: bool) -> dict[str, Any]:
    if cold:
        drop_page_cache(sorted(p for p in ckpt.iterdir() if p.is_file()))
    lines = dcp_ranks("restart", mib, world, ckpt, base / "dcp.jsonl")
    t0 = lines[0]["spawned_at"]

    def last(key: str) -> float:
        return max(x[key] for x in lines) - t0

    return {
        "dcp_restart_s": last("stepping_at"),
        "breakdown": {
            "start_and_import_s": last("imported_at"),
            "group_s": last("group_at") - last("imported_at"),
            "build_s": last("built_at") - last("group_at"),
            "load_s": last("loaded_at") - last("built_at"),
            "step_s": last("stepping_at") - last("loaded_at"),
        },
        "exact": all(x["exact"] for x in lines),
    }


# -- torchft ----------------------------------------------------------------------------------
def torchft_runs(mib: int, world: int, runs: int, base: Path) -> list[dict[str, Any]]:
    info, out = base / "torchft.json", base / "torchft.jsonl"
    shape = ["--rank", str(world - 2), "--world", str(world), "--mib-per-rank", str(mib)]
    script = str(JOBS / "torchft_job.py")
    source = subprocess.Popen(
        [sys.executable, script, "source", str(info), "--runs", str(runs), *shape],
        cwd=JOBS,
        stdin=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # torchft's HTTP server logs every request there
    )
    try:
        deadline = time.monotonic() + 120
        while not info.exists():
            if source.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("torchft's source process did not start")
            time.sleep(0.05)
        for run in range(runs):
            argv = [sys.executable, script, "receive", str(info), str(out), "--run", str(run)]
            spawned = time.time()
            code = subprocess.run(
                [*argv, *shape, "--spawned-at", repr(spawned)],
                cwd=JOBS,
                stderr=subprocess.DEVNULL,
                timeout=600,
            ).returncode
            if code:
                raise SystemExit(f"torchft's receiver failed (exit code {code})")
    finally:
        if source.stdin is not None:
            source.stdin.close()
        try:
            source.wait(timeout=30)
        except subprocess.TimeoutExpired:
            source.kill()
            source.wait()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    return [
        {
            "torchft_s": x["received_at"] - x["spawned_at"],
            "breakdown": {
                "start_and_import_s": x["imported_at"] - x["spawned_at"],
                "build_s": x["built_at"] - x["imported_at"],
                "group_s": x["group_at"] - x["built_at"],
                "transfer_s": x["received_at"] - x["group_at"],
            },
            "http_s": x["http_s"],
            "exact": x["pg_exact"] and x["http_exact"],
        }
        for x in lines
    ]


# -- the run ----------------------------------------------------------------------------------
def _median_dict(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def measure(mib: int, runs: int, cold_runs: int, base: Path, socket: float) -> dict[str, Any]:
    world, why = ranks_that_fit(mib)
    row: dict[str, Any] = {"ranks": world, "replicas": REPLICAS}
    if why:
        row["ranks_note"] = why
        print(f"  {why}", flush=True)
    row.update(copy_cost(mib))
    print(
        f"  the copy alone: {row['copy_fresh_cpu_s']:.3f} s CPU into fresh memory "
        f"({row['copy_fresh_page_faults']:.0f} page faults), {row['copy_touched_cpu_s']:.3f} s "
        "into touched memory",
        flush=True,
    )
    peer = []
    for i in range(runs):
        peer.append(peerckpt_run(mib, world, base))
        b = peer[-1]["breakdown"]
        print(
            f"  peerckpt run {i}: {peer[-1]['peerckpt_s']:.2f} s "
            f"({ {k: round(v, 3) for k, v in b.items()} }), exact {peer[-1]['exact']}",
            flush=True,
        )
    ckpt = base / f"dcp-{mib}"
    saved = dcp_ranks("save", mib, world, ckpt, base / "dcp.jsonl")
    warm = [dcp_restart(mib, world, ckpt, base, cold=False) for _ in range(runs)]
    cold = [dcp_restart(mib, world, ckpt, base, cold=True) for _ in range(cold_runs)]
    for name, rows in (("warm", warm), ("cold", cold)):
        print(
            f"  DCP restart ({name}): {[round(r['dcp_restart_s'], 2) for r in rows]} s", flush=True
        )
    ft = torchft_runs(mib, world, runs, base)
    print(
        f"  torchft: {[round(r['torchft_s'], 2) for r in ft]} s "
        f"(HTTP transfer {[round(r['http_s'], 2) for r in ft]} s)",
        flush=True,
    )
    nbytes = peer[0]["state_bytes_per_rank"]
    median_run = sorted(peer, key=lambda r: r["peerckpt_s"])[len(peer) // 2]
    breakdown = _median_dict([r["breakdown"] for r in peer])
    peer_s = statistics.median(r["peerckpt_s"] for r in peer)
    dcp_s = statistics.median(r["dcp_restart_s"] for r in warm)
    dcp_cold_s = statistics.median(r["dcp_restart_s"] for r in cold) if cold else None
    ft_s = statistics.median(r["torchft_s"] for r in ft)
    row.update(
        state_bytes_per_rank=nbytes,
        peerckpt_s=peer_s,
        peerckpt_runs=[r["peerckpt_s"] for r in peer],
        breakdown=breakdown,
        transfer_gbps=nbytes / breakdown["transfer_s"] / 1e9,
        transfer_ratio_to_socket=nbytes / breakdown["transfer_s"] / 1e9 / socket,
        transfer_from=peer[0]["transfer_from"],
        survivors_restore_s=statistics.median(r["survivors_restore_s"] for r in peer),
        waited_for_spares_s=[r["waited_for_spares_s"] for r in peer],
        restore_profile_median_run=median_run["restore_profile"],
        dcp_save_s=max(x["saved_at"] for x in saved) - saved[0]["spawned_at"],
        dcp_restart_s=dcp_s,
        dcp_restart_runs=[r["dcp_restart_s"] for r in warm],
        dcp_breakdown=_median_dict([r["breakdown"] for r in warm]),
        dcp_restart_cold_s=dcp_cold_s,
        dcp_restart_cold_runs=[r["dcp_restart_s"] for r in cold],
        torchft_s=ft_s,
        torchft_runs=[r["torchft_s"] for r in ft],
        torchft_breakdown=_median_dict([r["breakdown"] for r in ft]),
        torchft_http_s=statistics.median(r["http_s"] for r in ft),
        speedup_vs_dcp=dcp_s / peer_s,
        speedup_vs_dcp_cold=dcp_cold_s / peer_s if dcp_cold_s else None,
        speedup_vs_torchft=ft_s / peer_s,
        exact=all(r["exact"] for r in peer + warm + cold + ft),
        leftover_segments=[s for r in peer for s in r["leftover_segments"]],
    )
    return row


def reason(row: dict[str, Any]) -> str:
    """Where peerckpt's recovery time goes, from the run's breakdown, restore profile and the
    cost of the copy alone."""
    b = row["breakdown"]
    parts = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in b.items())
    profile = row["restore_profile_median_run"]
    # cProfile's rows: ncalls tottime percall cumtime percall where
    copy = [float(x.split()[3]) for x in profile if "copy_" in x and len(x.split()) > 5]
    total = [float(x.split()[3]) for x in profile if "tracking.py" in x and "(track)" in x]
    text = (
        f"{row['peerckpt_s']:.2f} s from the kill to every rank stepping: {parts}. The "
        f"transfer ran at {row['transfer_gbps']:.2f} GB/s "
        f"({row['transfer_ratio_to_socket']:.0%} of the loopback socket measured in this run)"
    )
    if copy and total:
        ranks, fresh = row["ranks"], row["copy_fresh_cpu_s"]
        text += (
            f"; the restore is the replacement copying its slot into the tensors it has just "
            f"built (cProfile of its ctx.track: {copy[0]:.2f} s of {total[0]:.2f} s in "
            f"Tensor.copy_). That copy alone needs {fresh:.2f} s of CPU "
            f"({row['copy_fresh_page_faults']:,.0f} first-touch page faults; "
            f"{row['copy_touched_cpu_s']:.2f} s into touched memory), and all {ranks} ranks "
            f"do it at once, since every survivor builds its model again and copies its own "
            f"state back (slowest survivor {row['survivors_restore_s']:.2f} s): ≈"
            f"{ranks * fresh:.2f} s of CPU on {psutil.cpu_count()} cores as measured alone; "
            "the rest of the restore's wall time is waiting for a core, or first touches that "
            "cost more in the job than alone"
        )
    return text


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--sizes", default="256,1024", help="MiB of state per rank")
    parser.add_argument(
        "--cold-runs", type=int, default=0, help="DCP restarts with the page cache dropped too"
    )
    parser.add_argument(
        "--cost-runs", type=int, default=3, help="jobs measuring the time a failure costs"
    )
    args = parser.parse_args()
    sizes = [64] if args.quick else [int(x) for x in args.sizes.split(",")]
    runs = 2 if args.quick else args.runs
    cost_runs = 2 if args.quick else args.cost_runs
    cold_runs = min(1, args.cold_runs) if args.quick else args.cold_runs
    load = background_load()
    print(f"background load before starting: {load}", flush=True)
    socket = socket_gbps(256 << 20, runs=3)
    print(f"loopback socket: {socket:.2f} GB/s", flush=True)
    result: dict[str, Any] = {
        "quick": args.quick,
        "runs": runs,
        "large_runs": args.large_runs,  # at 1 GiB and more (None: as many as runs)
        "kill_at_step": KILL_AT,
        "heartbeat_timeout_s": float(HEARTBEAT_TIMEOUT_S),
        "socket_gbps": socket,
    }
    if cold_runs < 5:
        result["cold_runs_note"] = (
            f"{cold_runs} DCP restarts with the page cache dropped per size (--cold-runs; a "
            "reference, not the compared figure: bench/reshard.py measures dcp.load from a "
            "cold cache), to keep `make bench` under 25 minutes"
        )
    rows: dict[str, Any] = {}
    with scratch_dir("recovery") as scratch:
        for mib in sizes:
            print(f"{mib} MiB per rank", flush=True)
            sub = Path(scratch) / str(mib)
            sub.mkdir()
            rows[f"{mib}MiB"] = measure(mib, runs_for(mib, runs, args), cold_runs, sub, socket)
        failure = None
        if 256 in sizes or args.quick:
            mib = 64 if args.quick else 256
            print(f"the time a failure costs, {mib} MiB × 4 ranks (bench/cost.py)", flush=True)
            failure = {"mib": mib, **cost.measure(mib, cost_runs, Path(scratch))}
            result["failure_cost"] = failure
    result["sizes"] = rows
    for key in ("peerckpt_s", "dcp_restart_s", "torchft_s", "speedup_vs_dcp"):
        result[key] = {size: row[key] for size, row in rows.items()}
    result["targets"] = {}
    for size, row in rows.items():
        t = target(row["speedup_vs_dcp"], 5, "higher", "×")
        if not t["met"]:
            t["reason"] = reason(row)
        result["targets"][f"speedup_vs_dcp_{size}"] = t
    for size, row in rows.items():
        t = target(row["transfer_ratio_to_socket"], 0.8, "higher")
        if not t["met"]:
            t["reason"] = reason(row)
        result["targets"][f"transfer_ratio_to_socket_{size}"] = t
    if "256MiB" in rows:
        t = target(rows["256MiB"]["peerckpt_s"], 2, "at most", " s")
        if not t["met"]:
            t["reason"] = reason(rows["256MiB"])
        result["targets"]["peerckpt_s_256MiB"] = t
    if failure is not None:
        size = f"{failure['mib']}MiB"
        ft_s = rows.get(size, {}).get("torchft_s")
        why = cost.reason(failure, ft_s)
        targets = {
            f"failure_cost_s_{size}": target(failure["cost_s"], 0.6, "at most", " s"),
            f"failure_cost_vs_torchft_{size}": target(
                ft_s / failure["cost_s"] if ft_s else None, 3, "higher", "×"
            ),
            f"transfer_ratio_in_training_{size}": target(
                failure["transfer_gbps"] / socket, 0.8, "higher"
            ),
        }
        for key, t in targets.items():
            if not t["met"]:
                t["reason"] = why
            result["targets"][key] = t
    path = write_result("recovery", result)
    print()
    print(
        f"{'per rank':>9} {'ranks':>5} {'peerckpt':>9} {'DCP':>7} {'DCP cold':>9} {'torchft':>8} {'×DCP':>6}"
    )
    for size, row in rows.items():
        cold = row["dcp_restart_cold_s"]
        print(
            f"{size:>9} {row['ranks']:>5} {row['peerckpt_s']:8.2f}s {row['dcp_restart_s']:6.2f}s "
            f"{(f'{cold:8.2f}s' if cold else '        -')} {row['torchft_s']:7.2f}s "
            f"{row['speedup_vs_dcp']:6.1f}"
        )
    print(f"every restore exact: {all(r['exact'] for r in rows.values())}; written {path}")


if __name__ == "__main__":
    main()
