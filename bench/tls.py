"""The cost of TLS on the data plane: a push over TLS against the same push in the clear.

    python bench/tls.py [--mib 512] [--runs 5] [--quick]

A child process runs two agents' data servers (``DataServer``, the code a real agent runs):
one in the clear, one with TLS forced (``PEERCKPT_TLS=on``, certificates derived from the
job's secret, mutual authentication). This process pushes the same checksummed snapshot to
each in turn (``transfer.push``: request → ``ready``, data frames, ``end`` → ``ack`` once the
receiver has verified every chunk), alternating so both see the same machine, and times each
push to its acknowledgement. A plain loopback socket (``sendall``/``recv_into``) is timed too
for scale. Results: ``bench/results/tls.json``; ``ratio_tls_to_clear`` is the figure (goal
≥ 0.8); ``ratio_tls_to_socket`` compares with the raw socket.

Kernel TLS (``ssl.OP_ENABLE_KTLS``) needs Python 3.12+ and a kernel with the ``tls`` module;
the result records whether it could be tried and what was negotiated (protocol, cipher).
"""

from __future__ import annotations

import os
import secrets
import ssl
import statistics
import sys
import time
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_parser, job_name, leftover_segments, socket_gbps, target, write_result

from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.replication.arena import Arena
from peerckpt.replication.store import SlotStore
from peerckpt.replication.transfer import DataServer, push
from peerckpt.wire import connect_tcp


def _receiver(job: str, secret: bytes, pipe: Pipe) -> None:
    """Two data servers, one clear and one TLS, until the parent says stop."""
    arenas, servers, addrs = [], [], []
    for node, mode in ((0, "off"), (1, "on")):
        os.environ["PEERCKPT_TLS"] = mode  # read when the server is built
        arena = Arena(job, node)
        server = DataServer(SlotStore(arena), secret, job, lambda: 0, lambda: None)
        server.start()
        arenas.append(arena)
        servers.append(server)
        addrs.append(server.address)
    pipe.send(addrs)
    try:
        pipe.recv()
    finally:
        for server in servers:
            server.stop()
        for arena in arenas:
            arena.destroy()


def _push_s(addr: str, mode: str, secret: bytes, job: str, manifest: Any, view: Any) -> float:
    os.environ["PEERCKPT_TLS"] = mode
    conn = connect_tcp(addr, secret, job, io_timeout=120.0)
    try:
        start = time.perf_counter()
        push(conn, 0, 0, 0, None, manifest, view)
        return time.perf_counter() - start
    finally:
        conn.close()


def _negotiated(addr: str, secret: bytes, job: str) -> dict[str, Any]:
    os.environ["PEERCKPT_TLS"] = "on"
    conn = connect_tcp(addr, secret, job)
    try:
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        return {"protocol": sock.version(), "cipher": (sock.cipher() or ("?",))[0]}
    finally:
        conn.close()


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--mib", type=int, default=512, help="snapshot size in MiB")
    args = parser.parse_args()
    mib, runs = (64, 2) if args.quick else (args.mib, args.runs)
    nbytes = mib << 20
    job, secret = job_name("tls"), secrets.token_bytes(32)
    view = memoryview(bytearray(os.urandom(1 << 20) * mib))
    chunk = ChunkRecord("w", "uint8", (nbytes,), (0,), (nbytes,), 0, nbytes)
    manifest = SnapshotManifest(0, 1, 0, (chunk,), nbytes).with_checksums(view)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(job, secret, there), daemon=True)
    child.start()
    clear_addr, tls_addr = here.recv()
    clear, secure = [], []
    try:
        for _ in range(2):  # warm-up: the receiver allocates its two replica slots
            _push_s(clear_addr, "off", secret, job, manifest, view)
            _push_s(tls_addr, "on", secret, job, manifest, view)
        for _ in range(runs):
            clear.append(_push_s(clear_addr, "off", secret, job, manifest, view))
            secure.append(_push_s(tls_addr, "on", secret, job, manifest, view))
        negotiated = _negotiated(tls_addr, secret, job)
    finally:
        here.send("stop")
        child.join(timeout=30)
    left = leftover_segments(job)
    clear_gbps = nbytes / statistics.median(clear) / 1e9
    tls_gbps = nbytes / statistics.median(secure) / 1e9
    raw_gbps = socket_gbps(nbytes, runs=max(2, runs // 2))
    ratio = tls_gbps / clear_gbps
    ktls = (
        "tried"
        if hasattr(ssl, "OP_ENABLE_KTLS")
        else f"Python {sys.version.split()[0]} has no ssl.OP_ENABLE_KTLS (3.12+)"
    )
    result = {
        "quick": args.quick,
        "snapshot_mib": mib,
        "runs": runs,
        "clear_gbps": round(clear_gbps, 3),
        "tls_gbps": round(tls_gbps, 3),
        "socket_gbps": round(raw_gbps, 3),
        "targets": {"ratio_tls_to_clear": target(round(ratio, 3), 0.8, "higher")},
        "ratio_tls_to_socket": round(tls_gbps / raw_gbps, 3),
        "ratio_clear_to_socket": round(clear_gbps / raw_gbps, 3),
        "tls": negotiated,
        "openssl": ssl.OPENSSL_VERSION,
        "ktls": ktls,
        "times_s": {"clear": [round(t, 4) for t in clear], "tls": [round(t, 4) for t in secure]},
        "leftover_segments": left,
    }
    if ratio < 0.8:
        result["targets"]["ratio_tls_to_clear"]["reason"] = (
            "user-space TLS (OpenSSL AES-256-GCM, TLS 1.3) encrypts and decrypts every byte on "
            "one core per side, and on loopback sender and receiver share the machine's cores; "
            f"kernel TLS could not be tried ({ktls}); see docs/security.md, Network"
        )
    path = write_result("tls", result)
    print(
        f"clear {clear_gbps:.2f} GB/s, TLS {tls_gbps:.2f} GB/s (ratio {ratio:.2f}), "
        f"socket {raw_gbps:.2f} GB/s; {negotiated}; written to {path}"
    )


if __name__ == "__main__":
    main()
