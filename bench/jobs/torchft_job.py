"""torchft's checkpoint transports moving one rank's state of ``state_job.py`` from a live
peer into a restarted process: the way torchft heals a replica today.

usage: torchft_job.py source INFO_JSON --runs N --rank R --world W --mib-per-rank M [--tensors T]
       torchft_job.py receive INFO_JSON OUT_JSONL --run I --rank R --world W --mib-per-rank M
                      [--tensors T] [--spawned-at T]

``source`` (the live peer) holds rank R's shards, starts a ``TCPStore`` and an
``HTTPTransport`` serving them, writes both addresses to INFO_JSON, then, N times, forms a
2-process torchft ``ProcessGroupGloo`` with the next receiver and sends the shards with
``PGTransport``; it exits when its standard input closes.

``receive`` (the restarted process): imports torch and torchft, allocates the shards
(uninitialised), joins the source's group and receives them in place with ``PGTransport``
(torchft's fast path), then fetches them once more with ``HTTPTransport`` (torchft's default,
into new tensors). Wall-clock times of each phase and whether each copy is exact go to
OUT_JSONL as one line.

Both transports deserialise what they receive with pickle (PGTransport its metadata,
HTTPTransport everything): they run here only as the comparison, on loopback, between two
processes of this benchmark.
"""

import time

imported_from = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from state_layout import exact, local_shards  # noqa: E402
from torchft.checkpointing.http_transport import HTTPTransport  # noqa: E402
from torchft.checkpointing.pg_transport import PGTransport  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

TIMEOUT = timedelta(seconds=120)


def source(args: argparse.Namespace) -> None:
    shards = local_shards(args, args.rank, fill=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    http = HTTPTransport(TIMEOUT, num_chunks=0)
    http.send_checkpoint(dst_ranks=[1], step=0, state_dict=shards, timeout=TIMEOUT)
    with open(args.info + ".tmp", "w") as f:
        json.dump({"store_port": store.port, "http": http.metadata()}, f)
    os.rename(args.info + ".tmp", args.info)
    for run in range(args.runs):
        pg = ProcessGroupGloo(timeout=TIMEOUT)
        pg.configure(f"127.0.0.1:{store.port}/run{run}", "0", rank=0, world_size=2)
        PGTransport(pg, TIMEOUT, torch.device("cpu")).send_checkpoint(
            dst_ranks=[1], step=run, state_dict=shards, timeout=TIMEOUT
        )
        pg.shutdown()
    sys.stdin.read()  # the benchmark closes it once the last receiver is done
    http.shutdown(wait=False)


def receive(args: argparse.Namespace) -> None:
    times = {"spawned_at": args.spawned_at or imported_from, "imported_at": time.time()}
    with open(args.info) as f:
        info = json.load(f)
    shards = local_shards(args, args.rank, fill=False)
    times["built_at"] = time.time()
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    pg.configure(f"127.0.0.1:{info['store_port']}/run{args.run}", "0", rank=1, world_size=2)
    times["group_at"] = time.time()
    PGTransport(pg, TIMEOUT, torch.device("cpu"), state_dict=lambda: shards).recv_checkpoint(
        src_rank=0, metadata="<n/a>", step=args.run, timeout=TIMEOUT
    )
    times["received_at"] = time.time()
    pg.shutdown()
    pg_exact = exact(args, args.rank, shards)
    http = HTTPTransport(TIMEOUT, num_chunks=0)
    start = time.time()
    fetched = http.recv_checkpoint(src_rank=0, metadata=info["http"], step=0, timeout=TIMEOUT)
    times["http_s"] = time.time() - start
    http.shutdown(wait=False)
    http_exact = exact(args, args.rank, fetched)
    with open(args.out, "a") as f:
        line = {"run": args.run, "pg_exact": pg_exact, "http_exact": http_exact, **times}
        f.write(json.dumps(line) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("source", "receive"))
    parser.add_argument("info")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--run", type=int, default=0)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--mib-per-rank", type=int, required=True)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--spawned-at", type=float, default=0.0)
    args = parser.parse_args()
    (source if args.role == "source" else receive)(args)


if __name__ == "__main__":
    main()
