"""Shared by the benchmarks: the machine's ceilings, medians, targets, and writing results.

Every benchmark writes ``bench/results/<name>.json`` through ``write_result``, which adds
what the figures were measured on (``machine()``), when, how long the benchmark took, and how
busy other processes kept the machine, before it started and on average while it ran
(``background_load``: other people's work on a shared machine moves every figure here). A
figure with a target goes in the result's ``targets`` through ``target()``;
``bench/summary.py`` turns those into the table at the top of ``docs/performance.md``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import mmap
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import psutil
import torch

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
REPO = BENCH.parent
_load_before: dict[str, Any] | None = None
_started = time.monotonic()  # the benchmark's start (this module is imported first)
_cpu_at_start = (psutil.cpu_times(), os.times())
# The benchmarks' jobs run with a longer heartbeat timeout than the default 5 s: before commit
# f90109b the agent read a rank's heartbeats in the thread that also allocated (touched) the
# rank's new 1 GiB slots, which took 2–4.3 s under load here, and it fenced healthy ranks
# twice when that took longer (py-spy dumps of the agent, 2026-11-22). A crash is detected
# when the rank's socket closes, whatever this timeout; only hangs wait for it.
HEARTBEAT_TIMEOUT_S = "30"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def median_of(runs: int, fn: Callable[[], float]) -> tuple[float, list[float]]:
    """Run ``fn`` ``runs`` times; return the median of what it returned and every value."""
    values = [fn() for _ in range(runs)]
    return statistics.median(values), values


def memcpy_gbps(nbytes: int = 1 << 30, runs: int = 5) -> float:
    """Copy between two touched buffers of ``nbytes`` (torch's copy_, one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)

        def once() -> float:
            start = time.perf_counter()
            dst.copy_(src)
            return nbytes / (time.perf_counter() - start) / 1e9

        return median_of(runs, once)[0]
    finally:
        torch.set_num_threads(threads)


def socket_gbps(nbytes: int = 1 << 30, runs: int = 3) -> float:
    """One loopback TCP connection: ``sendall`` of 64 MiB pieces, ``recv_into`` a buffer."""
    piece = memoryview(bytearray(64 << 20))
    sink = memoryview(bytearray(64 << 20))

    def once() -> float:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def receive() -> None:
            conn, _ = listener.accept()
            with conn:
                left = nbytes
                while left:
                    got = conn.recv_into(sink, min(left, len(sink)))
                    if not got:
                        return
                    left -= got

        thread = threading.Thread(target=receive, name="bench-socket-receiver")
        thread.start()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            start = time.perf_counter()
            for offset in range(0, nbytes, len(piece)):
                conn.sendall(piece[: min(len(piece), nbytes - offset)])
            thread.join(timeout=120)
            seconds = time.perf_counter() - start
        listener.close()
        return nbytes / seconds / 1e9

    return median_of(runs, once)[0]


def drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to drop the cached pages of ``paths`` (they are written back first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_gbps(paths: list[Path]) -> float:
    """Read ``paths`` once, cold (page cache dropped first), into one reused buffer."""
    drop_page_cache(paths)
    buffer = memoryview(bytearray(16 << 20))
    total = 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while got := f.readinto(buffer):
                total += got
    return total / (time.perf_counter() - start) / 1e9


def disk_write_gbps(path: Path, nbytes: int = 1 << 30) -> float:
    """Write ``nbytes`` to the new file ``path`` in 16 MiB pieces and fsync it; GB/s."""
    block = os.urandom(16 << 20)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        os.fsync(f.fileno())
    return max(nbytes, len(block)) / (time.perf_counter() - start) / 1e9


def disk_write_direct_gbps(path: Path, nbytes: int = 1 << 30) -> float:
    """Write ``nbytes`` to the new file ``path`` with O_DIRECT (16 MiB aligned writes, no page
    cache: the device's own write bandwidth) and fsync it; GB/s."""
    block = mmap.mmap(-1, 16 << 20)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(16 << 20))
    view = memoryview(block)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        start = time.perf_counter()
        for _ in range(max(1, nbytes // len(view))):
            os.write(fd, view)
        os.fsync(fd)
        return max(nbytes, len(view)) / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)
        view.release()
        block.close()


def disk_write_direct_parallel_gbps(paths: list[Path], nbytes: int = 1 << 30) -> float:
    """``disk_write_direct_gbps`` by one thread per path at once, ``nbytes`` in all (a flush
    has one writer per node, all on one disk here); GB/s of them together."""
    import threading

    share = nbytes // len(paths)
    start = time.perf_counter()
    threads = [
        threading.Thread(target=disk_write_direct_gbps, args=(path, share)) for path in paths
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return nbytes / (time.perf_counter() - start) / 1e9


def crc32c_gbps(nbytes: int = 1 << 30, runs: int = 5) -> float:
    """crc32c (the checksum the agents compute) over one touched buffer of ``nbytes``."""
    data = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))

    def once() -> float:
        start = time.perf_counter()
        crc32c.crc32c(data)
        return nbytes / (time.perf_counter() - start) / 1e9

    return median_of(runs, once)[0]


def scratch_dir(name: str) -> tempfile.TemporaryDirectory[str]:
    """A temporary directory on the local disk (not tmpfs), removed when closed."""
    base = os.environ.get("PEERCKPT_BENCH_DIR") or tempfile.gettempdir()
    return tempfile.TemporaryDirectory(prefix=f".bench-{name}-", dir=base)


def bench_parser(doc: str | None) -> Any:
    """An argument parser with the flags every benchmark has: ``--runs``, ``--large-runs``
    (``runs_for``) and ``--quick``."""
    import argparse

    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="repetitions of each measurement")
    parser.add_argument(
        "--large-runs",
        type=int,
        default=None,
        help=f"repetitions at {LARGE_MIB} MiB per rank and more (default: --runs)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: small sizes, 2 runs (not figures)"
    )
    return parser


LARGE_MIB = 1024  # sizes from here on may take fewer runs (--large-runs): each job is long


def runs_for(mib: int, runs: int, args: Any) -> int:
    """How many runs a size gets: ``runs``, or ``--large-runs`` from ``LARGE_MIB`` up."""
    large = getattr(args, "large_runs", None)
    return min(runs, large) if mib >= LARGE_MIB and large is not None else runs


def background_load() -> dict[str, Any]:
    """How busy the machine is before a benchmark starts: CPU use over one second (other
    people's processes: nothing of the benchmark runs yet) and the load averages."""
    global _load_before
    if _load_before is None:
        _load_before = {
            "cpu_percent_1s": psutil.cpu_percent(interval=1.0),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "available_memory_gib": round(psutil.virtual_memory().available / 2**30, 1),
        }
    return _load_before


def _busy_s(cpu: Any) -> float:
    return float(sum(cpu) - cpu.idle - getattr(cpu, "iowait", 0.0))


def others_cores() -> float:
    """Cores that other processes kept busy, on average, since this benchmark started: the
    machine's busy CPU time less this process's and its descendants' (every process of a job
    is waited for by its parent, so its CPU time ends up in ours)."""
    machine0, ours0 = _cpu_at_start
    machine1, ours1 = psutil.cpu_times(), os.times()
    mine = sum(ours1[:4]) - sum(ours0[:4])
    wall = time.monotonic() - _started
    return max(0.0, _busy_s(machine1) - _busy_s(machine0) - mine) / max(wall, 1e-9)


def under_load(load: dict[str, Any]) -> bool:
    """Whether other work kept the machine noticeably busy: more than 15% of its cores in the
    second before the start, or more than a quarter of a core on average throughout."""
    before = load.get("cpu_percent_1s") or 0.0
    return bool(before > 15.0 or load.get("others_cores_avg", 0.0) > 0.25)


def target(value: float | None, goal: float, better: str, unit: str = "") -> dict[str, Any]:
    """A figure against its target: ``better`` is ``"lower"`` (value < goal), ``"at most"``
    (value ≤ goal) or ``"higher"`` (value ≥ goal). ``met`` is None when the figure could not
    be measured; a missed target gets a ``reason`` from the benchmark."""
    checks = {
        "lower": ("<", lambda v: v < goal),
        "at most": ("≤", lambda v: v <= goal),
        "higher": ("≥", lambda v: v >= goal),
    }
    sign, check = checks[better]
    met = None if value is None else bool(check(value))
    return {"value": value, "target": f"{sign} {goal:g}{unit}", "met": met}


def steady(times: list[float], skip: int) -> float:
    """The median of ``times`` after the first ``skip`` (warm-up: first touches, first
    snapshots into fresh slots)."""
    return statistics.median(times[skip:] if len(times) > skip else times)


def job_name(prefix: str) -> str:
    """A job name unique to this process and call (slots and sockets are named after it)."""
    job_name.count = getattr(job_name, "count", 0) + 1  # type: ignore[attr-defined]
    return f"{prefix}{os.getpid()}x{job_name.count}"  # type: ignore[attr-defined]


def leftover_segments(job: str) -> list[str]:
    """Remove and return any shared-memory file the job left in /dev/shm (there should be
    none: the agents and the launcher clean up; a benchmark must never leave memory taken)."""
    left = sorted(glob.glob(f"/dev/shm/peerckpt-{job}-*"))
    for path in left:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return left


def start_peerckpt(args: list[str], log_level: str = "WARNING") -> subprocess.Popen[str]:
    """Start ``peerckpt run ARGS…`` from the repository; its output is captured."""
    env = dict(os.environ, PEERCKPT_LOG_LEVEL=log_level)
    argv = [sys.executable, "-m", "peerckpt.launch", "run", *args]
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run_peerckpt(args: list[str], log_level: str = "WARNING") -> subprocess.CompletedProcess[str]:
    """``peerckpt run ARGS…`` from the repository; exit the benchmark if the job fails."""
    launcher = start_peerckpt(args, log_level)
    try:
        stdout, stderr = launcher.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        launcher.terminate()  # the launcher stops and cleans up its job
        stdout, stderr = launcher.communicate(timeout=60)
    proc = subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr)
    if proc.returncode != 0:
        log = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"the peerckpt job failed ({proc.returncode}):\n{log}")
    return proc


def write_result(name: str, result: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` with the machine it was measured on and the load
    the machine carried (a quick run writes ``<name>-quick.json``: not figures)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}{'-quick' if result.get('quick') else ''}.json"
    payload = {
        "benchmark": name,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "bench_seconds": round(time.monotonic() - _started, 1),
        **result,
    }
    load = dict(_load_before or {}, others_cores_avg=round(others_cores(), 2))
    payload["background_load"] = dict(
        load, under_load=under_load(load), loadavg_at_end=[round(x, 2) for x in os.getloadavg()]
    )
    payload["machine"] = machine()
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
