"""A process that runs every reader of durable roots on roots it is given, in bounded memory.

``python -m tests.persist.bounded_reader`` reads one JSON request per line on stdin —
``{"url": URL}`` — and answers one JSON line per request on stdout: for each reader
(``inspect --verify --tensors``, the cold start's ``open``, ``slot_image`` and ``meta`` of
every rank, ``export`` to safetensors, the DCP reader's metadata) ``"ok"`` or the exception
raised (its class, whether it is a ``CheckpointError``, its message), and the peak of Python
allocations in all of them (tracemalloc).

Its address space is capped (``RLIMIT_AS``) at what it used after a first round of every
reader, plus :data:`HEADROOM`: an allocation a hostile root makes beyond that — a tensor torch
allocates outside tracemalloc's view, a buffer of gigabytes — fails at once as a
``MemoryError`` or a torch ``RuntimeError`` (which the test refuses), without touching the
test machine's memory. ``tests/persist/test_hostile_roots.py`` drives it.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import psutil

from peerckpt.errors import CheckpointError
from peerckpt.persist.durable import DurableStore
from peerckpt.persist.inspect import inspect
from peerckpt.persist.interop import PeerckptReader, export_safetensors

HEADROOM = 1 << 30  # address space a request may add past the first round's


def _cold_start(url: str) -> None:
    """What a cold start reads: the manifest, then every rank's chunks and state blob."""
    ckpt = DurableStore(url).open()
    for rank in ckpt.manifest.ranks:
        ckpt.slot_image(rank)
        ckpt.meta(rank)


def _readers(url: str, out: str) -> dict[str, Callable[[], Any]]:
    return {
        "inspect": lambda: inspect(url, verify=True, tensors=True),
        "cold start": lambda: _cold_start(url),
        "export": lambda: export_safetensors(url, out),
        "dcp": lambda: PeerckptReader(url).read_metadata(),
    }


def read_all(url: str, out: str) -> dict[str, Any]:
    """Run every reader on ``url``; what each did and the peak of Python allocations."""
    outcomes: dict[str, Any] = {}
    tracemalloc.start()
    started = time.monotonic()
    try:
        for name, reader in _readers(url, out).items():
            try:
                reader()
                outcomes[name] = "ok"
            except Exception as exc:
                outcomes[name] = {
                    "type": type(exc).__name__,
                    "checkpoint_error": isinstance(exc, CheckpointError),
                    "message": str(exc)[:2000],
                }
            finally:
                if os.path.exists(out):
                    os.unlink(out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {"outcomes": outcomes, "peak": peak, "seconds": time.monotonic() - started}


def main() -> int:
    logging.basicConfig(level=logging.ERROR)  # a damaged step is logged as a warning: expected
    private = tempfile.mkdtemp(prefix="peerckpt-bounded-reader-")
    out = os.path.join(private, "export.safetensors")
    capped = False
    try:
        for line in sys.stdin:
            request = json.loads(line)
            answer = read_all(request["url"], out)
            if not capped and request.get("warm_up"):
                # Every library is loaded and every reader ran once: cap what is left.
                used = psutil.Process().memory_info().vms
                hard = resource.getrlimit(resource.RLIMIT_AS)[1]
                resource.setrlimit(resource.RLIMIT_AS, (used + HEADROOM, hard))
                capped = True
            print(json.dumps(answer), flush=True)
    finally:
        os.rmdir(private)
    return 0


if __name__ == "__main__":
    sys.exit(main())
