"""Shared by the benchmarks: the machine's ceilings, medians, and writing results."""

from __future__ import annotations

import json
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

import psutil
import torch

RESULTS = Path(__file__).resolve().parent / "results"


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


def scratch_dir(name: str) -> tempfile.TemporaryDirectory[str]:
    """A temporary directory on the local disk (not tmpfs), removed when closed."""
    base = os.environ.get("PEERCKPT_BENCH_DIR") or tempfile.gettempdir()
    return tempfile.TemporaryDirectory(prefix=f".bench-{name}-", dir=base)


def run_peerckpt(args: list[str], log_level: str = "WARNING") -> subprocess.CompletedProcess[str]:
    """``peerckpt run ARGS…`` from the repository; exit the benchmark if the job fails."""
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PEERCKPT_LOG_LEVEL=log_level)
    argv = [sys.executable, "-m", "peerckpt", "run", *args]
    proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        log = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"the peerckpt job failed ({proc.returncode}):\n{log}")
    return proc


def write_result(name: str, result: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` with the machine it was measured on."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), **result}
    payload["machine"] = machine()
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
