"""The coordinator process: hosts the job's TCPStore (bound to its address only, behind an
authenticated gate when ranks reach it from other hosts) and serves the Coordinator over gRPC.

Started by a launcher as ``python -m peerckpt.recovery.server``; prints one ``READY {json}``
line with its address on stdout once it serves, and runs until SIGTERM or until its launcher
is gone. The job's secret comes from ``PEERCKPT_SECRET``, the launcher's durable settings
from ``PEERCKPT_PERSIST`` (``persist/config.py``): a URL may hold credentials, and a command
line is readable by every user of the host.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from peerckpt.coding import parse_spec
from peerckpt.persist.config import from_env as persist_from_env
from peerckpt.recovery.coordinator import Coordinator
from peerckpt.recovery.erasure import ErasurePlacement
from peerckpt.recovery.placement import Placement, placement_by_name
from peerckpt.rpc import RpcServer
from peerckpt.service import service_process, stop_on_signals
from peerckpt.storegate import StoreGate, bound_socket, tunnelled

log = logging.getLogger("peerckpt.coordinator")


def _placement(args: argparse.Namespace) -> Placement:
    """Buddies by ``--placement`` and ``--racks``; with ``--erasure``, no buddies but
    parity groups, in the same node order (``recovery/erasure.py``)."""
    racks = {int(n): r for n, r in json.loads(args.racks).items()} if args.racks else None
    placement = placement_by_name(args.placement, racks)
    if args.erasure:
        return ErasurePlacement(parse_spec(args.erasure), placement)
    return placement


def main(argv: list[str] | None = None) -> int:
    """Run a coordinator process; print one READY line with its addresses on stdout."""
    parser = argparse.ArgumentParser(prog="python -m peerckpt.recovery.server")
    parser.add_argument("--job", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0)
    parser.add_argument(
        "--stall-timeout", type=float, default=None, help="fence a rank stuck this long"
    )
    parser.add_argument("--min-nodes", type=int, default=None)
    parser.add_argument("--spares", type=int, default=0, help="spares the launcher starts")
    parser.add_argument("--placement", default="ring")
    parser.add_argument("--racks", default=None, help="node → rack, as JSON")
    parser.add_argument("--erasure", default=None, help="K+M: parity instead of replicas")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--digests-file", default=None, help="append snapshot digests here")
    parser.add_argument("--port", type=int, default=0, help="the RPC port (0: any free one)")
    parser.add_argument("--store-port", type=int, default=0, help="the TCPStore's port")
    parser.add_argument(
        "--moved-from",
        default=None,
        help="the host of the coordinator this one replaces, which died (its nodes are lost)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restarts in place per rank over the job, carried out by the launcher (peerckpt "
        "run passes its --max-restarts); 0: none",
    )
    parser.add_argument(
        "--restart-based",
        action="store_true",
        help="every worker restarts after any failure (torchrun): wait for them",
    )
    args = parser.parse_args(argv)
    if args.stall_timeout is not None and not (1.0 <= args.stall_timeout < float("inf")):
        parser.error(f"--stall-timeout {args.stall_timeout:g}: give at least 1 second")
    secret = service_process(f"coordinator job={args.job}")
    store, gate = _rendezvous_store(secret, args.job, args.host, args.store_port)
    coordinator = Coordinator(
        args.job,
        args.world_size,
        args.replicas,
        args.heartbeat_timeout,
        f"{args.host}:{gate.port if gate is not None else store.port}",
        min_nodes=args.min_nodes,
        spares=args.spares,
        placement=_placement(args),
        persist=persist_from_env(),
        digests_file=args.digests_file,
        restart_based=args.restart_based,
        moved_from=args.moved_from,
        max_restarts=args.max_restarts,
        stall_timeout=args.stall_timeout,
    )
    unary, streams = coordinator.handlers()
    server = RpcServer(
        secret,
        args.job,
        unary,
        streams,
        host=args.host,
        port=args.port,
        inline=Coordinator.INLINE,
    )
    server.start()
    parent = os.getppid()

    stop_on_signals(coordinator.stopped.set)
    store_port = gate.port if gate is not None else store.port
    print("READY " + json.dumps({"address": server.address, "store_port": store_port}), flush=True)
    try:
        while not coordinator.stopped.wait(0.2):
            coordinator.check_heartbeats()
            if os.getppid() != parent:
                log.warning("launcher is gone; stopping")
                break
    finally:
        coordinator.close()
        server.stop()
        if gate is not None:
            gate.stop()
        del store
    return 0


def _rendezvous_store(
    secret: bytes, job: str, host: str, port: int
) -> tuple[Any, StoreGate | None]:
    """The TCPStore every epoch's group meets in, bound to one address, never a wildcard
    (torch's own bind is every interface); behind the authenticated gate when ranks reach
    it from other hosts (``peerckpt/storegate.py``). A restarted coordinator listens where
    the first one did: agents and ranks know it there."""
    from torch.distributed import TCPStore

    tunnel = tunnelled(host)
    sock = bound_socket("127.0.0.1" if tunnel else host, 0 if tunnel else port)
    store_port = sock.getsockname()[1]
    # The store owns the descriptor from here on (it closes it).
    store = TCPStore(
        sock.getsockname()[0],
        store_port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    if not tunnel:
        return store, None
    gate = StoreGate(secret, job, host, port, store_port)
    gate.start()
    return store, gate


if __name__ == "__main__":
    sys.exit(main())
