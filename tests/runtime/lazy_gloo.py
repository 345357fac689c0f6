"""One rank of a three-process gloo group with lazily connected pairs, for ``test_lazy_gloo.py``.

usage: python -m tests.runtime.lazy_gloo RANK STORE_ADDR PG_TIMEOUT_S

Every rank forms the group through ``ProcessGroupLifecycle`` (``PEERCKPT_GLOO_LAZY`` decides
whether its pairs connect lazily) and runs one all-reduce, which connects them. Rank 2 then
stops itself (SIGSTOP: its connections stay open, as when its node is lost, so no peer sees
them close). Ranks 0 and 1 start a second all-reduce, which waits for rank 2, and abort their
epoch a second later, as the runtime does when told. Ranks 0 and 1 print one JSON line:
the sockets the group opened while forming and at its first all-reduce, the sockets the
abort cut, and how the second all-reduce ended and after how long.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from peerckpt.runtime.pg import ProcessGroupLifecycle, _socket_inodes

WORLD = 3


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def main() -> None:
    rank, store_addr, timeout_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    host, _, port = store_addr.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False)
    pg = ProcessGroupLifecycle("lazy-gloo", timeout_s=timeout_s, backend="gloo")
    pg.begin(0, store_addr, {host})
    before = set(_socket_inodes())
    pg.join(store_addr, rank, WORLD)
    formed = set(_socket_inodes())
    faulthandler.dump_traceback_later(60.0)  # where a rank that hangs is, in the test's output
    dist.all_reduce(torch.ones(8))
    first = set(_socket_inodes()) - formed
    if rank == 2:
        store.set("pid2", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # the test kills it
    pid = int(store.get("pid2"))
    while not _stopped(pid):
        time.sleep(0.05)
    cut: list[int] = []
    threading.Timer(1.0, lambda: cut.append(pg.abort())).start()
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8))
        outcome = "finished"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    seconds = time.monotonic() - started
    time.sleep(0.2)  # the abort's timer thread has returned its count
    result = {
        "rank": rank,
        "lazy": pg.gloo_lazy,
        "opened_forming": len(formed - before),
        "opened_first_all_reduce": len(first),
        "cut": cut[0] if cut else None,
        "all_reduce": outcome,
        "seconds": round(seconds, 3),
    }
    print(json.dumps(result), flush=True)
    pg.leave()
    os._exit(0)  # gloo processes here now and then abort at exit (see ddp_gloo.py)


if __name__ == "__main__":
    main()
