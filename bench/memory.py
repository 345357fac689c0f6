"""Host memory: what a peerckpt job holds per rank, against 2·(1+k)·S.

    python bench/memory.py [--mib 256] [--runs 5] [--quick]

A job of ``bench/jobs/train_job.py`` (an MLP and its AdamW state: S MiB per rank), 2 nodes ×
2 ranks, one buddy per rank (k = 1), a snapshot every step. While it runs, this process
samples every 50 ms:

* the job's shared memory: the bytes allocated to its files in /dev/shm (``st_blocks``),
  per node and in total;
* every process of the job (ranks, agents, coordinator): RSS, and of it ``RssAnon`` (its
  private heap) and ``RssShmem`` (the shared slots it maps), from /proc/<pid>/status.

The same loop without peerckpt (``train_job.py --plain``) gives a rank's own private memory.
The design allows 2·(1+k)·S of host memory per rank for snapshots (two own slots, two replica
slots per buddy) and nothing hidden, so:

    overhead_ratio = (peak shared memory + the agents' peak private memory
                      + what each rank holds privately beyond the plain loop)
                     / (ranks · 2·(1+k)·S)

``shm_ratio`` is the shared memory alone over the same; ``overhead_ratio_with_job_processes``
adds the launcher's and the coordinator's private memory (once per job, not per rank).
Medians of ``--runs`` jobs.
Results: ``bench/results/memory.json``.

**Redundancy-aware replication** (``--dedup-only`` runs this case alone): the same job with
``--ddp`` (one model under DistributedDataParallel: every rank's parameters and AdamW state
are equal), once with ``resilient(dedup=False)`` and once with the default, alternating, in
the same run. For each: the peak of the buddies' *replica* segments in /dev/shm (their
``st_blocks``: a partial copy never touches the pages of the chunks it lacks) and the CPU
seconds of all agents per snapshot step (from the first rank's probes, over the steps of
``ctx.steps``). ``memory_ratio`` and ``agents_cpu_ratio`` are dedup / no-dedup, medians of
the pairs; targets: memory ratio ≤ 0.5 (parameters and optimizer state dominate the
snapshot), agents' CPU ratio ≤ 0.5 (what remains is the crc32c of each rank's own slot).
Results: ``bench/results/dedup.json``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    background_load,
    bench_parser,
    job_name,
    leftover_segments,
    scratch_dir,
    start_peerckpt,
    target,
    write_result,
)

JOB = Path(__file__).resolve().parent / "jobs" / "train_job.py"
NODES, PER_NODE, REPLICAS = 2, 2, 1
SAMPLE_S = 0.05
REPLICA = re.compile(r"-r\d+-g\d+-")  # a buddy's replica slot (peerckpt/shm.py); own: -o<rank>-


def _status(pid: int) -> dict[str, int]:
    """RSS, RssAnon and RssShmem of ``pid`` in bytes (empty if it is gone)."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssShmem"):
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        return {}
    return fields


def _role(proc: psutil.Process) -> str | None:
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if "peerckpt.replication.agent" in cmdline:
        node = proc.cmdline()[proc.cmdline().index("--node") + 1]
        return f"agent{node}"
    if "peerckpt.recovery.server" in cmdline:
        return "coordinator"
    if str(JOB) in cmdline:
        try:
            env = proc.environ()
        except psutil.Error:
            return None
        return f"{env.get('PEERCKPT_ROLE', 'rank')}-pid{proc.pid}"
    return None


class Sampler:
    """Peak memory of a process tree and of a job's /dev/shm files, sampled in a thread."""

    def __init__(self, root: int, shm_prefix: str | None) -> None:
        self.root, self.prefix = root, shm_prefix
        self.peak: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.shm_peak = 0
        self.replica_peak = 0  # the buddies' replica segments alone
        self.shm_peak_per_node: dict[str, int] = defaultdict(int)
        self._roles: dict[int, str | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory-sampler")

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(SAMPLE_S)

    def sample(self) -> None:
        try:
            procs = [psutil.Process(self.root), *psutil.Process(self.root).children(True)]
        except psutil.Error:
            procs = []
        for proc in procs:
            if proc.pid not in self._roles:
                if self.prefix is None:
                    self._roles[proc.pid] = "plain"
                elif proc.pid == self.root:
                    self._roles[proc.pid] = "launcher"
                else:
                    self._roles[proc.pid] = _role(proc)
            role = self._roles[proc.pid]
            if role is None:
                continue
            for key, value in _status(proc.pid).items():
                self.peak[role][key] = max(self.peak[role][key], value)
        if self.prefix is None:
            return
        total, replicas, per_node = 0, 0, defaultdict[str, int](int)
        for entry in os.scandir("/dev/shm"):
            if entry.name.startswith(self.prefix):
                try:
                    used = entry.stat().st_blocks * 512
                except FileNotFoundError:
                    continue
                total += used
                replicas += used if REPLICA.search(entry.name) else 0
                per_node[entry.name[len(self.prefix) :].split("-")[0]] += used
        self.shm_peak = max(self.shm_peak, total)
        self.replica_peak = max(self.replica_peak, replicas)
        for node, used in per_node.items():
            self.shm_peak_per_node[node] = max(self.shm_peak_per_node[node], used)


def plain_run(mib: int, steps: int, out: Path) -> tuple[int, int]:
    """The loop without peerckpt: its peak private memory and its state size."""
    argv = [sys.executable, str(JOB), str(out), "--mib", str(mib), "--batch", "1"]
    proc = subprocess.Popen([*argv, "--steps", str(steps), "--plain"])
    with Sampler(proc.pid, None) as sampler:
        if proc.wait(timeout=600):
            raise SystemExit(f"the plain loop failed (exit code {proc.returncode})")
    state = json.loads((out / "steps-plain-rank0.json").read_text())["state_bytes"]
    return sampler.peak["plain"]["RssAnon"], state


def job_run(mib: int, steps: int, out: Path, flags: tuple[str, ...] = ()) -> dict[str, Any]:
    job = job_name("benchmem")
    argv = ["--nodes", str(NODES), "--nproc-per-node", str(PER_NODE)]
    argv += ["--replicas", str(REPLICAS), "--job", job, str(JOB), str(out)]
    argv += ["--mib", str(mib), "--batch", "1", "--steps", str(steps), *flags]
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
        raise SystemExit(f"the job failed:\n{(stdout + stderr)[-2000:]}")
    return {
        "shm_peak": sampler.shm_peak,
        "replica_peak": sampler.replica_peak,
        "shm_peak_per_node": dict(sampler.shm_peak_per_node),
        "processes": {k: dict(v) for k, v in sampler.peak.items()},
        "leftover_segments": left,
    }


def agents_cpu_per_step(out: Path) -> float:
    """All agents' CPU seconds per snapshot step, from rank 0's probes over ``ctx.steps``."""
    probes = json.loads((out / "steps-peerckpt-rank0.json").read_text())["probes"]
    return (probes[-1][2] - probes[0][2]) / (len(probes) - 1)


def dedup_case(mib: int, steps: int, runs: int, base: Path, quick: bool) -> dict[str, Any]:
    """The DDP job without and with redundancy-aware replication, alternating: the buddies'
    replica memory and the agents' CPU per step, as ratios dedup / no-dedup."""
    pairs: list[dict[str, Any]] = []
    for i in range(runs):
        pair: dict[str, Any] = {}
        for name, flags in (("whole", ("--ddp", "--no-dedup")), ("dedup", ("--ddp",))):
            out = base / f"ddp-{name}{i}"
            out.mkdir()
            got = job_run(mib, steps, out, flags)
            pair[name] = {
                "replica_peak": got["replica_peak"],
                "shm_peak": got["shm_peak"],
                "agents_cpu_s_per_step": agents_cpu_per_step(out),
                "leftover_segments": got["leftover_segments"],
            }
        pair["memory_ratio"] = pair["dedup"]["replica_peak"] / pair["whole"]["replica_peak"]
        pair["agents_cpu_ratio"] = (
            pair["dedup"]["agents_cpu_s_per_step"] / pair["whole"]["agents_cpu_s_per_step"]
        )
        print(
            f"DDP pair {i}: replicas' peak {pair['whole']['replica_peak'] / 2**20:.1f} MiB whole, "
            f"{pair['dedup']['replica_peak'] / 2**20:.2f} MiB deduplicated "
            f"({pair['memory_ratio']:.2e}); agents' CPU per step "
            f"{pair['whole']['agents_cpu_s_per_step'] * 1e3:.0f} → "
            f"{pair['dedup']['agents_cpu_s_per_step'] * 1e3:.0f} ms "
            f"({pair['agents_cpu_ratio']:.3f})",
            flush=True,
        )
        pairs.append(pair)
    memory = statistics.median(p["memory_ratio"] for p in pairs)
    cpu = statistics.median(p["agents_cpu_ratio"] for p in pairs)
    t = target(memory, 0.5, "at most")
    if not t["met"]:
        t["reason"] = (
            f"the buddies' replicas took {memory:.3f} of their whole-push size: the chunks not "
            "declared data-parallel (blob, buffers) outweigh the parameters and AdamW state"
        )
    c = target(cpu, 0.5, "at most")
    if not c["met"]:
        c["reason"] = (
            f"the agents still took {cpu:.3f} of their whole-push CPU per step: each checksums "
            "its ranks' whole snapshots (the twins' digests need every declared chunk's crc32c)"
        )
    result = {
        "quick": quick,
        "runs": runs,
        "ranks": NODES * PER_NODE,
        "replicas": REPLICAS,
        "mib_per_rank": mib,
        "steps": steps,
        "memory_ratio": memory,
        "agents_cpu_ratio": cpu,
        "pairs": pairs,
        "targets": {"memory_ratio": t, "agents_cpu_ratio": c},
    }
    path = write_result("dedup", result)
    print(f"dedup: memory_ratio {memory:.2e} (target ≤ 0.5), agents_cpu_ratio {cpu:.3f}; {path}")
    return result


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--mib", type=int, default=256, help="state per rank")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dedup-mib", type=int, default=64, help="state per rank, DDP case")
    parser.add_argument("--dedup-only", action="store_true", help="only the DDP dedup case")
    parser.set_defaults(runs=3)
    args = parser.parse_args()
    mib = 64 if args.quick else args.mib
    runs = 2 if args.quick else args.runs
    if args.dedup_only:
        background_load()
        with scratch_dir("memory") as scratch:
            dedup_case(
                16 if args.quick else args.dedup_mib, args.steps, runs, Path(scratch), args.quick
            )
        return
    note = None
    if runs < 5:
        note = (
            f"{runs} runs, to keep `make bench` under 25 minutes: the figures are the same to "
            "the third digit from run to run (shared memory is allocated, not sampled noise)"
        )
    load = background_load()
    print(f"background load before starting: {load}", flush=True)
    ranks = NODES * PER_NODE
    with scratch_dir("memory") as scratch:
        base = Path(scratch)
        (base / "plain").mkdir()
        plain_anon, state = plain_run(mib, args.steps, base / "plain")
        print(f"plain loop: {plain_anon / 2**20:.0f} MiB private, state {state / 2**20:.0f} MiB")
        allowed = ranks * 2 * (1 + REPLICAS) * state
        rows = []
        for i in range(runs):
            (base / f"job{i}").mkdir()
            got = job_run(mib, args.steps, base / f"job{i}")
            procs = got["processes"]
            agents = sum(v.get("RssAnon", 0) for k, v in procs.items() if k.startswith("agent"))
            rank_rows = [v for k, v in procs.items() if k.startswith("rank")]
            extra = sum(max(0, v.get("RssAnon", 0) - plain_anon) for v in rank_rows)
            fixed = sum(procs.get(k, {}).get("RssAnon", 0) for k in ("launcher", "coordinator"))
            got.update(
                agents_private_peak=agents,
                ranks_private_beyond_plain=extra,
                job_processes_private_peak=fixed,
                overhead_ratio=(got["shm_peak"] + agents + extra) / allowed,
                overhead_ratio_with_job_processes=(got["shm_peak"] + agents + extra + fixed)
                / allowed,
                shm_ratio=got["shm_peak"] / allowed,
            )
            rows.append(got)
            print(
                f"run {i}: shared memory peak {got['shm_peak'] / 2**30:.2f} GiB "
                f"({got['shm_ratio']:.3f} of 2·(1+k)·S·ranks), agents' private "
                f"{agents / 2**20:.0f} MiB, ranks beyond the plain loop {extra / 2**20:.0f} MiB: "
                f"overhead_ratio {got['overhead_ratio']:.3f}",
                flush=True,
            )
    ratio = statistics.median(r["overhead_ratio"] for r in rows)
    median_run = sorted(rows, key=lambda r: r["overhead_ratio"])[len(rows) // 2]
    result: dict[str, Any] = {
        "quick": args.quick,
        "runs": runs,
        "runs_note": note,
        "ranks": ranks,
        "replicas": REPLICAS,
        "state_bytes_per_rank": state,
        "allowed_bytes": allowed,
        "plain_rank_private_peak": plain_anon,
        "overhead_ratio": ratio,
        "shm_ratio": statistics.median(r["shm_ratio"] for r in rows),
        "overhead_ratio_with_job_processes": statistics.median(
            r["overhead_ratio_with_job_processes"] for r in rows
        ),
        "overhead_ratio_runs": [r["overhead_ratio"] for r in rows],
        "median_run": median_run,
    }
    t = target(ratio, 1.05, "at most")
    if not t["met"]:
        over = median_run["shm_peak"] + median_run["agents_private_peak"]
        t["reason"] = (
            f"peak shared memory {median_run['shm_peak'] / 2**30:.2f} GiB against "
            f"{allowed / 2**30:.2f} GiB allowed ({median_run['shm_ratio']:.3f}); the agents' "
            f"private memory {median_run['agents_private_peak'] / 2**20:.0f} MiB; the ranks "
            f"{median_run['ranks_private_beyond_plain'] / 2**20:.0f} MiB beyond the plain loop "
            f"(shared + agents: {over / allowed:.3f})"
        )
    result["targets"] = {"overhead_ratio": t}
    print(f"overhead_ratio {ratio:.3f} (target ≤ 1.05); written {write_result('memory', result)}")
    with scratch_dir("memory") as scratch:
        dedup_case(
            16 if args.quick else args.dedup_mib, args.steps, runs, Path(scratch), args.quick
        )


if __name__ == "__main__":
    main()
