"""Erasure-coded redundancy (``--erasure K+M``) against buddy replicas: memory, CPU, recovery.

    python bench/erasure.py [--sizes 64 256] [--runs 1] [--quick]

Three measurements, each at every ``--sizes`` MiB per rank, all ratios from the same run:

* **memory per node**: ``bench/jobs/train_job.py`` (an MLP and its AdamW state, S MiB per
  rank), 1 rank per node, a snapshot every step, run with ``--replicas 1``, ``--replicas 2``
  (4 nodes), ``--erasure 3+1`` (4 nodes) and ``--erasure 3+2`` (5 nodes); the peak of the
  job's /dev/shm per node (``bench/memory.py``'s sampler: the bytes allocated to its files).
  Targets: 3+1's peak ≤ 0.75 of ``--replicas 1``'s (the issue's bar; the design's own
  figure is (2 + 2·M/K)·S against (2 + 2k)·S: 0.67), 3+2's ≤ 0.75 of ``--replicas 2``'s.
* **encode CPU per GB**: a parity holder folding K pieces into each of its M parity rows
  (``replication/parity.py``'s ``ParityStore.fold``, in this process), CPU seconds per GB of
  snapshot encoded (every parity row counted: M rows per snapshot byte), against memcpy's
  CPU seconds per GB (the ceiling: a fold reads the piece and reads and writes the parity).
  Also each Galois-field library that is importable, encoding the same stripe whole (the
  candidates of ``peerckpt/gf256.py``'s docstring).
* **recovery time**: five in-process agents (``DataServer``s on loopback); each rank's
  snapshot is encoded 3+2 over them and one rank is pushed to a buddy; then rank 1 is rebuilt
  (``replication/decoding.py``: K pieces per stripe pulled in parallel and decoded) against
  a plain pull of its replica (``obtain_committed``), alternating, medians of ``--runs``.

Results: ``bench/results/erasure.json``.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    bench_parser,
    job_name,
    leftover_segments,
    memcpy_gbps,
    scratch_dir,
    start_peerckpt,
    target,
    write_result,
)
from memory import JOB, Sampler

from peerckpt.coding import Coding, ErasureSpec, parity_matrix
from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.replication.arena import Arena
from peerckpt.replication.parity import ParityStore

CONFIGS = {
    "replicas 1": (4, ["--replicas", "1"]),
    "replicas 2": (4, ["--replicas", "2"]),
    "erasure 3+1": (4, ["--erasure", "3+1"]),
    "erasure 3+2": (5, ["--erasure", "3+2"]),
}


def memory_run(mib: int, config: str, steps: int, out: Path) -> dict[str, Any]:
    nodes, flags = CONFIGS[config]
    job = job_name("benchec")
    argv = ["--nodes", str(nodes), "--nproc-per-node", "1", *flags, "--job", job]
    argv += [str(JOB), str(out), "--mib", str(mib), "--batch", "1", "--steps", str(steps)]
    launcher = start_peerckpt(argv)
    try:
        with Sampler(launcher.pid, f"peerckpt-{job}-") as sampler:
            stdout, stderr = launcher.communicate(timeout=900)
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.wait(timeout=60)
        left = leftover_segments(job)
    if launcher.returncode:
        raise SystemExit(f"the {config} job failed:\n{(stdout + stderr)[-2000:]}")
    per_node = dict(sampler.shm_peak_per_node)
    return {
        "nodes": nodes,
        "shm_peak": sampler.shm_peak,
        "shm_peak_per_node": per_node,
        "shm_peak_per_node_max": max(per_node.values()) if per_node else 0,
        "shm_per_node_mean": sampler.shm_peak / nodes,
        "leftover_segments": left,
    }


FSDP_HIDDEN = 65536  # ≈ 4.6 MiB of parameters and AdamW state per rank of 4


def fsdp_job_shm(flags: list[str], out: Path) -> dict[str, Any]:
    """Peak /dev/shm of the FSDP2 test job (``tests/jobs/reshard_job.py --kind fsdp``), 4
    nodes × 1 rank and a spare, its MLP widened to ``FSDP_HIDDEN``: at the tests' width (a
    few kilobytes of state) a rank's own slots hold 64 KiB more than the state (the blob's
    room) and every mode holds the same, so the ratio says nothing about redundancy (0.925
    measured there)."""
    job = job_name("benchecfsdp")
    out.mkdir(parents=True, exist_ok=True)
    script = Path(__file__).resolve().parent.parent / "tests" / "jobs" / "reshard_job.py"
    argv = ["--nodes", "4", "--nproc-per-node", "1", "--spares", "1", *flags, "--job", job]
    argv += [str(script), str(out), "--kind", "fsdp", "--steps", "12", "--hidden", str(FSDP_HIDDEN)]
    launcher = start_peerckpt(argv)
    try:
        with Sampler(launcher.pid, f"peerckpt-{job}-") as sampler:
            stdout, stderr = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.wait(timeout=60)
        left = leftover_segments(job)
    if launcher.returncode:
        raise SystemExit(f"the FSDP2 job {flags} failed:\n{(stdout + stderr)[-2000:]}")
    return {"shm_peak": sampler.shm_peak, "leftover_segments": left}


def encode_cpu(mib: int, spec: ErasureSpec, runs: int) -> dict[str, Any]:
    """CPU seconds per GB of snapshot for a holder's folds (every parity row of a stripe)."""
    k, m = spec.k, spec.m
    piece = (mib << 20) // k
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 256, piece, dtype=np.uint8) for _ in range(k)]
    manifest = SnapshotManifest(0, 1, 0, (ChunkRecord("w", "uint8", (1,), (0,), (1,), 0, 1),), 1)
    arena = Arena(job_name("benchecenc"), 0)
    try:
        store = ParityStore(arena)
        times = []
        for run in range(runs + 1):  # the first run faults the parity's pages in
            start = time.process_time()
            for t in range(m):
                key = (0, (0, 1, 2), 0, t)
                for p, data in enumerate(pieces):
                    store.fold(key, run, None, k, p, parity_matrix(k, m)[t][p], p, data, manifest)
            if run:
                times.append(time.process_time() - start)
    finally:
        arena.destroy()
    seconds = statistics.median(times)
    snapshot_gb = k * piece / 1e9
    return {"cpu_s_per_gb": seconds / snapshot_gb, "runs_s": times, "rows": m}


def memcpy_cpu_per_gb(mib: int, runs: int = 5) -> float:
    """CPU seconds per GB of one memcpy of ``mib`` MiB (median of ``runs``; pages touched)."""
    src = np.ones(mib << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(runs):
        start = time.process_time()
        np.copyto(dst, src)
        times.append(time.process_time() - start)
    return statistics.median(times) / (src.size / 1e9)


def libraries(mib: int, spec: ErasureSpec) -> dict[str, Any]:
    """Each importable library encoding one stripe whole: GB of data per CPU second."""
    k, m = spec.k, spec.m
    data = np.random.default_rng(1).integers(0, 256, (mib << 20) // k * k, dtype=np.uint8)
    blocks = [bytes(b) for b in np.split(data, k)]
    out: dict[str, Any] = {}

    def timed(name: str, fn: Any) -> None:
        start = time.process_time()
        fn()
        out[name] = round(data.size / 1e9 / max(1e-9, time.process_time() - start), 3)

    try:
        from pyeclib.ec_iface import ECDriver

        driver = ECDriver(k=k, m=m, ec_type="isa_l_rs_vand")
        timed("pyeclib isa_l_rs_vand, GB/s", lambda: driver.encode(data.tobytes()))
    except Exception as exc:
        out["pyeclib"] = f"not measured: {type(exc).__name__}"
    try:
        import zfec

        enc = zfec.Encoder(k, k + m)
        timed("zfec, GB/s", lambda: enc.encode(blocks, list(range(k, k + m))))
    except Exception as exc:
        out["zfec"] = f"not measured: {type(exc).__name__}"
    try:
        import galois

        field = galois.GF(2**8)
        arr = field(data[: 16 << 20])
        start = time.process_time()
        _ = field(7) * arr
        out["galois scalar × array, GB/s"] = round(
            arr.size / 1e9 / max(1e-9, time.process_time() - start), 3
        )
    except Exception as exc:
        out["galois"] = f"not measured: {type(exc).__name__}"
    return out


def recovery(mib: int, runs: int) -> dict[str, Any]:
    """Rebuild of one rank (3+2 over 5 in-process agents) against a pull of its replica."""
    import secrets

    from peerckpt.coding import Group
    from peerckpt.replication.decoding import rebuild
    from peerckpt.replication.encoding import Encoding, pieces_of
    from peerckpt.replication.obtain import obtain_committed
    from peerckpt.replication.replicator import ReplicationJob
    from peerckpt.replication.store import SlotStore
    from peerckpt.replication.transfer import DataServer, push
    from peerckpt.states import SlotKind
    from peerckpt.wire import connect_tcp

    name, secret = job_name("benchecrec"), secrets.token_bytes(32)
    size = mib << 20
    nodes = range(5)
    arenas = [Arena(name, n) for n in nodes]
    stores = [SlotStore(a) for a in arenas]
    servers = [DataServer(s, secret, name, lambda: 0, lambda: None) for s in stores]
    coding = Coding(ErasureSpec(3, 2), (Group(tuple(nodes), tuple(nodes), 3, 2),))
    encodings: list[Encoding] = []
    try:
        for server in servers:
            server.start()
        addrs = {n: servers[n].address for n in nodes}
        done = threading.Semaphore(0)
        expected = 0
        rng = np.random.default_rng(2)
        for rank in nodes:
            slot = stores[rank].ensure(SlotKind.OWN, 0, rank, 0, size)
            np.frombuffer(slot.segment.view, dtype=np.uint8)[:] = rng.integers(
                0, 256, size, dtype=np.uint8
            )
            chunks = (ChunkRecord("w", "uint8", (size,), (0,), (size,), 0, size),)
            manifest = SnapshotManifest(rank, 1, 0, chunks, size).with_checksums(slot.segment.view)
            slot.manifest = manifest
            pieces = pieces_of(coding, rank, manifest)
            owner = Encoding(name, secret, lambda: 0, lambda: None, lambda j, n, e: done.release())
            encodings.append(owner)
            with slot.lock:
                job = ReplicationJob.start(0, slot, manifest, sorted({p.node for p in pieces}))
            expected += len(job.buddies)
            owner.submit(job, pieces, addrs)
        for _ in range(expected):
            if not done.acquire(timeout=300):
                raise SystemExit("encoding never finished")
        original = stores[1].find(0, 1, 1)
        assert original is not None and original.manifest is not None
        conn = connect_tcp(addrs[2], secret, name)
        push(conn, 0, 0, 1, None, original.manifest, original.segment.view)
        conn.close()
        restore = {"coding": coding.to_msg(), "holders": {r: r for r in nodes if r != 1}}
        connect = lambda node: connect_tcp(addrs[node], secret, name)  # noqa: E731
        alive = set(nodes) - {1}
        rebuilt_s, pulled_s = [], []
        for _ in range(runs):
            start = time.perf_counter()
            got = rebuild(stores[0], 0, 0, 1, 1, restore, alive, connect, index=1)
            rebuilt_s.append(time.perf_counter() - start)
            assert bytes(got.slot.segment.view[:64]) == bytes(original.segment.view[:64])
            stores[0].release_where(lambda s: s.rank == 1)
            start = time.perf_counter()
            obtain_committed(stores[3], 3, 0, 0, 1, 1, [2], connect)
            pulled_s.append(time.perf_counter() - start)
            stores[3].release_where(lambda s: s.rank == 1)
        return {
            "rebuild_s": statistics.median(rebuilt_s),
            "replica_pull_s": statistics.median(pulled_s),
            "rebuild_over_pull": statistics.median(rebuilt_s) / statistics.median(pulled_s),
            "runs": {"rebuild_s": rebuilt_s, "replica_pull_s": pulled_s},
            "pulled_bytes": sum(got.pulled.values()),
        }
    finally:
        for owner in encodings:
            owner.stop()
        for server in servers:
            server.stop()
        for arena in arenas:
            arena.destroy()


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    sizes, runs = ([8], 1) if args.quick else (args.sizes, args.runs)
    memcpy = memcpy_gbps(256 << 20, runs=3)
    result: dict[str, Any] = {"quick": args.quick, "memcpy_gbps": memcpy, "sizes": {}}
    targets: dict[str, Any] = {}
    with scratch_dir("erasure-fsdp") as tmp:
        fsdp = {
            "replicas 1": fsdp_job_shm(["--replicas", "1"], Path(tmp) / "r1"),
            "erasure 3+1": fsdp_job_shm(["--erasure", "3+1"], Path(tmp) / "e31"),
        }
    fsdp_ratio = fsdp["erasure 3+1"]["shm_peak"] / fsdp["replicas 1"]["shm_peak"]
    result["fsdp2_job"] = {**fsdp, "shm_peak_3_1_over_replicas_1": fsdp_ratio}
    targets[
        "FSDP2 test job, 4 nodes × 1 rank + a spare: peak /dev/shm, erasure 3+1 / replicas 1"
    ] = target(round(fsdp_ratio, 3), 0.75, "at most")
    print(f"FSDP2 test job: peak /dev/shm 3+1 / replicas 1 = {fsdp_ratio:.3f}", flush=True)
    for mib in sizes:
        per: dict[str, Any] = {"memory": {}}
        with scratch_dir("erasure") as tmp:
            for config in CONFIGS:
                per["memory"][config] = memory_run(mib, config, args.steps, Path(tmp) / config)
        mem = per["memory"]
        ratio_31 = mem["erasure 3+1"]["shm_per_node_mean"] / mem["replicas 1"]["shm_per_node_mean"]
        ratio_32 = mem["erasure 3+2"]["shm_per_node_mean"] / mem["replicas 2"]["shm_per_node_mean"]
        per["shm_per_node_3_1_over_replicas_1"] = ratio_31
        per["shm_per_node_3_2_over_replicas_2"] = ratio_32
        memcpy_cpu = memcpy_cpu_per_gb(mib)
        per["memcpy_cpu_s_per_gb"] = memcpy_cpu
        for spec in (ErasureSpec(3, 1), ErasureSpec(3, 2)):
            enc = encode_cpu(mib, spec, max(5, runs))
            enc["over_memcpy"] = enc["cpu_s_per_gb"] / memcpy_cpu
            per[f"encode {spec}"] = enc
        per["libraries 3+2"] = libraries(min(mib, 64), ErasureSpec(3, 2))
        per["recovery"] = recovery(mib, max(1, runs))
        result["sizes"][mib] = per
        targets[f"{mib} MiB per rank, 4 nodes: /dev/shm per node, erasure 3+1 / replicas 1"] = (
            target(round(ratio_31, 3), 0.75, "at most")
        )
        targets[f"{mib} MiB per rank, 5 nodes: /dev/shm per node, erasure 3+2 / replicas 2"] = (
            target(round(ratio_32, 3), 0.75, "at most")
        )
        print(
            f"{mib} MiB/rank: /dev/shm per node 3+1/replicas 1 = {ratio_31:.3f}, "
            f"3+2/replicas 2 = {ratio_32:.3f}; encode CPU per GB / memcpy: "
            f"3+1 {per['encode 3+1']['over_memcpy']:.2f}, 3+2 {per['encode 3+2']['over_memcpy']:.2f}; "
            f"rebuild {per['recovery']['rebuild_s']:.3f} s vs replica pull "
            f"{per['recovery']['replica_pull_s']:.3f} s ({per['recovery']['rebuild_over_pull']:.2f}×)",
            flush=True,
        )
    result["targets"] = targets
    path = write_result("erasure", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
