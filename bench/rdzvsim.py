"""Simulated ranks forming an epoch's process group against the job's rendezvous store.

Part of ``bench/scale.py``. Each simulated rank speaks torch's TCPStore protocol itself (no
torch in the simulated ranks: a non-blocking socket and a few bytes each, thousands per
process) and makes exactly the store calls ``init_process_group`` makes through
``runtime/pg.py`` (a ``TCPStore`` client, the epoch's ``PrefixStore`` and torch's
``default_pg`` prefix), as recorded from torch 2.13 with a store that logs every call:

- connecting: ``VALIDATE`` (the protocol's magic number) and ``PING``, answered with the
  client's nonce (the ``TCPStore(..., is_master=False)`` constructor);
- ``nccl`` (the GPU backend): rank 0 sets the NCCL unique id (128 bytes) under the
  communicator's counter ``0``; every other rank gets it (``get`` is a ``WAIT`` for the key,
  then a ``GET``);
- ``gloo`` (the CPU backend, eager, torch's default): every rank sets its pair addresses
  under ``0//cpu//0/<rank>`` (154 + 8 × world bytes), then waits for and gets every rank's,
  its own included: world² gets, each of O(world) bytes;
- ``gloo_lazy`` (``TORCH_GLOO_LAZY_INIT=1``): every rank sets its key (154 bytes) and gets,
  at its first collective, only the peers the algorithm connects it to (a ring's two).

No barrier: torch skips the store-based barrier unless ``TORCH_DIST_INIT_BARRIER=1``.
``simulate`` runs one share of the ranks in this process and reports when each finished.
Benchmark code: nothing here is imported by the package.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import time
from typing import Any

MAGIC = 0x3C85F7CE
VALIDATE, SET, GET, WAIT, PING = 0, 1, 3, 6, 13
NCCL_ID = 128
GLOO_BASE = 154  # bytes of a rank's gloo address with no pairs; 8 more per rank of the world
PATTERNS = ("nccl", "gloo", "gloo_lazy", "gpu")  # gpu: nccl and gloo_lazy, one after the other


def _key(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _set(key: str, value: bytes) -> bytes:
    return bytes([SET]) + _key(key) + struct.pack("<Q", len(value)) + value


def _get(key: str) -> list[tuple[bytes, str]]:
    """A client ``get``: WAIT for the key (1 byte back), then GET (length and value back)."""
    return [
        (bytes([WAIT]) + struct.pack("<Q", 1) + _key(key), "byte"),
        (bytes([GET]) + _key(key), "value"),
    ]


def steps(pattern: str, rank: int, world: int, prefix: str) -> list[tuple[bytes, str]]:
    """Rank ``rank``'s requests, each with what answers it (``none``, ``byte``, ``nonce``,
    ``value``), for ``pattern`` (see the module docstring)."""
    out = [(bytes([VALIDATE]) + struct.pack("<I", MAGIC), "none")]
    out.append((bytes([PING]) + struct.pack("<I", rank & 0xFFFFFFFF), "nonce"))
    parts = ("nccl", "gloo_lazy") if pattern == "gpu" else (pattern,)
    for part in parts:
        if part == "nccl":
            key = f"{prefix}0"
            out += [(_set(key, os.urandom(NCCL_ID)), "none")] if rank == 0 else _get(key)
        elif part == "gloo":
            out.append((_set(f"{prefix}0//cpu//0/{rank}", bytes(GLOO_BASE + 8 * world)), "none"))
            for peer in range(world):
                out += _get(f"{prefix}0//cpu//0/{peer}")
        elif part == "gloo_lazy":
            out.append((_set(f"{prefix}0//cpu//0/{rank}", bytes(GLOO_BASE)), "none"))
            for peer in sorted({(rank + 1) % world, (rank - 1) % world} - {rank}):
                out += _get(f"{prefix}0//cpu//0/{peer}")
    return out


class _Rank:
    """One simulated rank's connection and where it is in its requests."""

    def __init__(self, rank: int, requests: list[tuple[bytes, str]]) -> None:
        self.rank = rank
        self.requests = requests
        self.at = 0
        self.inbox = bytearray()
        self.done: float | None = None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_until_answer(self) -> None:
        """Send requests up to the next one that is answered (or the last)."""
        while self.at < len(self.requests):
            data, answer = self.requests[self.at]
            self.sock.sendall(data)  # small: fits the socket's buffer
            if answer != "none":
                return
            self.at += 1

    def answered(self) -> bool:
        """Whether the inbox holds the answer to the current request (consumed if so)."""
        kind = self.requests[self.at][1]
        need = {"byte": 1, "nonce": 4}.get(kind)
        if need is None:  # a value: 8 bytes of length, then the value
            if len(self.inbox) < 8:
                return False
            need = 8 + struct.unpack_from("<Q", self.inbox)[0]
        if len(self.inbox) < need:
            return False
        del self.inbox[:need]
        self.at += 1
        return True


def simulate(
    ranks: list[int], world: int, pattern: str, port: int, prefix: str, ready: Any, go: Any
) -> dict[str, Any]:
    """Run ``ranks`` of a ``world``-rank group: prepare them, put ``"ready"`` on ``ready``,
    take the start time (monotonic) from ``go``, start then. When each finished (seconds
    after the start) and this process's CPU time."""
    sims = [_Rank(r, steps(pattern, r, world, prefix)) for r in ranks]
    sel = selectors.DefaultSelector()
    ready.put("ready")
    start_at = go.get(timeout=600)
    time.sleep(max(0.0, start_at - time.monotonic()))
    cpu = time.process_time()
    for sim in sims:  # every rank connects at once, as an epoch's ranks do
        sim.sock.connect_ex(("127.0.0.1", port))
        sel.register(sim.sock, selectors.EVENT_WRITE, sim)
    left = len(sims)
    deadline = start_at + 600.0
    while left and time.monotonic() < deadline:
        for key, events in sel.select(timeout=1.0):
            sim = key.data
            if events & selectors.EVENT_WRITE:  # connected: its first requests
                if sim.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    raise SystemExit(f"rank {sim.rank} could not connect to the store")
                sel.modify(sim.sock, selectors.EVENT_READ, sim)
                sim.send_until_answer()
                continue
            data = sim.sock.recv(1 << 20)
            if not data:
                raise SystemExit(f"the store closed rank {sim.rank}'s connection")
            sim.inbox += data
            while sim.at < len(sim.requests) and sim.answered():
                sim.send_until_answer()
            if sim.at == len(sim.requests):
                sim.done = time.monotonic() - start_at
                sel.unregister(sim.sock)
                left -= 1
    cpu = time.process_time() - cpu
    done = [s.done for s in sims]
    for sim in sims:
        sim.sock.close()
    if left:
        raise SystemExit(f"{left} simulated ranks did not finish within 600 s")
    return {"done": done, "cpu_s": cpu}
