"""One rank of a three-process gloo DDP scenario for ``test_inflight.py``.

usage: python -m tests.runtime.ddp_gloo RANK STORE_ADDR MODE PG_TIMEOUT_S

``stuck-hook`` / ``stuck-plain``: rank 0's gradient all-reduce is left with a send gloo never
ends. gloo's ring sends to rank - 1 and receives from rank + 1. Rank 2 posts a receive of a
large tensor from rank 0, then starts its backward (a DDP): its all-reduce posts its first
receives from rank 0, sends its first segment to rank 1 and waits for rank 0. Rank 1 (a plain
all-reduce of the same size, so that its main thread is free) sees that segment arrive in its
tensor, which proves rank 2's receives are posted, and says so; rank 2 then stops itself
(SIGSTOP). Rank 0 sends the large tensor, which the stopped peer never reads: its rest waits
in the connection's queue, and so does every later send to rank 2, however small. Then rank
0 runs its backward: its receive from rank 1 completes and it waits for its first send to
rank 2, queued. Its abort (``ProcessGroupLifecycle``) then cuts the connections. With
``stuck-hook`` the DDP routes its all-reduce through ``release_on_abort``, as the runtime
does. Rank 0 prints one JSON line: how the backward ended and how many groups its lifecycle
kept.

``broadcast-hook`` / ``broadcast-plain``: the same queued send to rank 2, then rank 0 runs a
forward of a DDP with BatchNorm buffers (``broadcast_buffers=True``): its buffer broadcast
posts a send to rank 2, whose receive rank 2 posted in its own forward before it stopped,
behind the queued one. Rank 0's abort then cuts the connections. With ``broadcast-hook`` every
rank's DDP goes through ``release_on_abort``. Rank 0 prints how the forward ended, how long
it took and how many groups its lifecycle kept.

``user-hook`` / ``user-plain``: the same queued send to rank 2, then rank 0 runs the script's
own blocking ``dist.all_reduce`` (the distributed tutorial's gradient averaging), whose ring
sends to rank 2 behind it; ranks 1 and 2 run it too (rank 2 stops itself first). With
``user-hook`` it is the one a job's training process finds (``runtime/usercoll.py``); with
``user-plain``, torch's own. Rank 0 prints how the call ended, how long it took and how many
groups its lifecycle kept.

``bits-hook`` / ``bits-plain``: three steps of a small DDP with and without the hook; every
rank prints the digest of its gradients and of its BatchNorm buffers as each forward's
broadcast left them (they must be equal: neither the hook nor the broadcast changes a bit).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from peerckpt.runtime import usercoll
from peerckpt.runtime.inflight import release_on_abort
from peerckpt.runtime.pg import ProcessGroupLifecycle

WORLD = 3


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def stuck(rank: int, store: dist.TCPStore, pg: ProcessGroupLifecycle, hook: bool) -> None:
    torch.manual_seed(0)
    # One parameter, one bucket; no collective at construction (rank 1 is no DDP).
    ddp = DistributedDataParallel(nn.Linear(1024, 2048, bias=False), init_sync=False)
    # 64 MiB: far more than a connection buffers (at most a few MiB here) once its reader stops
    large = torch.zeros(16 << 20) if rank != 1 else None
    if hook:
        assert release_on_abort(ddp)
    x = torch.ones(4, 1024)
    if rank == 1:
        mine = torch.zeros(2048 * 1024)  # rank 2's segment makes it non-zero
        dist.all_reduce(mine, async_op=True)
        while not bool(mine.any()):
            time.sleep(0.01)
        store.set("rank 2 posted", "1")
        time.sleep(3600)  # waits for rank 2 like everyone; the test kills it
    if rank == 2:

        def stop_once_posted() -> None:
            store.wait(["rank 2 posted"])
            os.kill(os.getpid(), signal.SIGSTOP)

        store.set("pid2", str(os.getpid()))
        threading.Thread(target=stop_once_posted, daemon=True).start()
        assert large is not None
        dist.irecv(large, src=0)
        ddp(x).sum().backward()  # never returns: rank 0 never gets its segments through
        return
    assert large is not None
    _behind_a_queued_send(store, pg, large, "backward", lambda: ddp(x).sum().backward())


def _behind_a_queued_send(
    store: dist.TCPStore,
    pg: ProcessGroupLifecycle,
    large: torch.Tensor,
    what: str,
    call: Callable[[], object],
) -> None:
    """Rank 0, once rank 2 is stopped: queue a send to it that gloo never ends, abort the
    group 3 s later, run ``call`` (which waits behind that send) and print how it ended."""
    pid = int(store.get("pid2"))
    while not _stopped(pid):
        time.sleep(0.05)
    queued = dist.isend(large, dst=2)  # noqa: F841 (kept: gloo holds its buffer meanwhile)
    threading.Timer(3.0, pg.abort).start()  # by then rank 0 waits for its send to rank 2
    started = time.monotonic()
    try:
        call()
        outcome = "finished"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    pg.leave()
    result = {what: outcome, "seconds": time.monotonic() - started, "kept": pg.kept()}
    print(json.dumps(result), flush=True)


def stuck_broadcast(rank: int, store: dist.TCPStore, pg: ProcessGroupLifecycle, hook: bool) -> None:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), init_sync=False
    )
    if hook:
        assert release_on_abort(ddp)
    x = torch.ones(4, 8)
    if rank in (1, 2):
        if rank == 2:
            large = torch.zeros(16 << 20)
            dist.irecv(large, src=0)

            def stop_once_posted() -> None:
                time.sleep(1.0)  # the forward's receive from rank 0 is posted by then
                store.set("pid2", str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)

            threading.Thread(target=stop_once_posted, daemon=True).start()
        ddp(x)  # never returns on rank 2: rank 0's broadcast never gets through
        time.sleep(3600)  # the test kills it
    _behind_a_queued_send(store, pg, torch.zeros(16 << 20), "forward", lambda: ddp(x))


def stuck_user(rank: int, store: dist.TCPStore, pg: ProcessGroupLifecycle, hook: bool) -> None:
    all_reduce = (usercoll.REPLACED if hook else usercoll.ORIGINALS)["all_reduce"]
    grad = torch.ones(1 << 18)  # a layer's gradient, 1 MiB
    if rank in (1, 2):
        if rank == 2:
            dist.irecv(torch.zeros(16 << 20), src=0)

            def stop_once_posted() -> None:
                time.sleep(1.0)  # its all-reduce's receive from rank 0 is posted by then
                store.set("pid2", str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)

            threading.Thread(target=stop_once_posted, daemon=True).start()
        all_reduce(grad)  # never returns: rank 0's segments never get through
        time.sleep(3600)  # the test kills it
    _behind_a_queued_send(store, pg, torch.zeros(16 << 20), "all_reduce", lambda: all_reduce(grad))


def bits(rank: int, hook: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 64), nn.BatchNorm1d(64)
    )
    ddp = DistributedDataParallel(model)
    # Three buckets (more than two in flight), of two tensors each: a bucket of one is
    # broadcast in place, of more through a flat copy that must be copied back.
    ddp.broadcast_bucket_size = 2048  # bytes
    if hook:
        assert release_on_abort(ddp)
    received = hashlib.sha256()  # the buffers as each forward's broadcast left them

    def digest_buffers(module: nn.Module, args: Any) -> None:
        for buffer in module.buffers():
            received.update(buffer.numpy().tobytes())

    model.register_forward_pre_hook(digest_buffers)
    data = torch.Generator().manual_seed(rank)
    digest = hashlib.sha256()
    for _ in range(3):  # the first iteration in the initial buckets, then the rebuilt ones
        ddp(torch.randn(8, 64, generator=data)).pow(2).mean().backward()
        for p in ddp.parameters():
            assert p.grad is not None
            digest.update(p.grad.numpy().tobytes())
            p.grad = None
    result = {"rank": rank, "digest": digest.hexdigest(), "buffers": received.hexdigest()}
    print(json.dumps(result), flush=True)


def main() -> None:
    rank, store_addr, mode, timeout_s = (
        int(sys.argv[1]),
        sys.argv[2],
        sys.argv[3],
        float(sys.argv[4]),
    )
    host, _, port = store_addr.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False)
    pg = ProcessGroupLifecycle("ddp-gloo", timeout_s=timeout_s, backend="gloo")
    pg.begin(0, store_addr, {host})
    pg.join(store_addr, rank, WORLD)
    faulthandler.dump_traceback_later(60.0)  # where a rank that hangs is, in the test's output
    kind, _, variant = mode.partition("-")
    if kind == "stuck":
        stuck(rank, store, pg, variant == "hook")  # rank 0 then exits as any process does
    elif kind == "broadcast":
        stuck_broadcast(rank, store, pg, variant == "hook")
    elif kind == "user":
        stuck_user(rank, store, pg, variant == "hook")
    else:
        bits(rank, variant == "hook")
        # gloo processes here now and then abort at exit ("terminate called without an active
        # exception"), with or without the hook; this case checks the digests only.
        os._exit(0)


if __name__ == "__main__":
    main()
