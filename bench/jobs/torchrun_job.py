"""One job for ``bench/torchrun.py``, run under torchrun two ways.

usage: torchrun ... torchrun_job.py OUT --mode peerckpt|dcp --mib M [--steps N] [--ckpt DIR]

The state: a small DDP model (the collective of every step) and a frozen parameter of M MiB
per rank (``Blob``), different on every rank. ``--mode peerckpt``: the function is decorated
with ``@peerckpt.resilient`` and snapshots every step. ``--mode dcp``: a plain torchrun script
that saves both with ``torch.distributed.checkpoint`` to DIR after every step (``step-S``,
then ``latest`` names it once every rank saved), and when it finds one at start (a restart)
drops its files from the page cache (``posix_fadvise``) and loads ``latest``. Each process appends
``{"step", "t", "restart", "pid"}`` to OUT/steps.jsonl after every step (``t``: wall clock).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


class Blob(nn.Module):
    """M MiB of frozen state per rank, different on each."""

    def __init__(self, mib: int, rank: int) -> None:
        super().__init__()
        n = mib * 2**20 // 4
        self.weight = nn.Parameter(torch.full((n,), float(rank)), requires_grad=False)


def step_once(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    x = torch.ones(8, 64)
    model(x).sum().backward()
    optim.step()
    optim.zero_grad()


def record(out: str, step: int) -> None:
    line = {
        "step": step,
        "t": time.time(),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "pid": os.getpid(),
    }
    with open(os.path.join(out, "steps.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def run_peerckpt(args: argparse.Namespace) -> None:
    import peerckpt

    @peerckpt.resilient(every=1)
    def train(ctx: peerckpt.Context) -> None:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Linear(64, 64))
        optim = torch.optim.SGD(model.parameters(), lr=0.01)
        blob = Blob(args.mib, ctx.rank)
        ctx.track(model=model, optim=optim, blob=blob)
        for step in ctx.steps(args.steps):
            step_once(model, optim)
            record(args.out, step)
            time.sleep(args.sleep)

    train()


def drop_cache(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dcp_state(model: nn.Module, blob: Blob, rank: int) -> dict[str, object]:
    # Each rank's blob under a key of its own: DCP saves a tensor that every rank has under
    # one name once, as replicated, and this state differs per rank.
    return {"model": model.state_dict(), "blob": {f"r{rank}": blob.weight}}


def init_fresh_group() -> None:
    """The default group, on torchrun's store under a prefix of this attempt's own.

    torch 2.13's torchrun keeps one store for the workers across restarts and
    ``init_process_group("gloo")`` reuses the same keys in every attempt, so a restarted
    worker can read a dead one's address (seen here: "Gloo connectFullMesh failed ...
    Connection refused", and the restart failed). Every attempt starts exactly
    ``WORLD_SIZE`` workers, so counting arrivals names the attempt alike on every host.
    """
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    attempt = (store.add("bench/arrivals", 1) - 1) // world
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"bench/attempt{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=world,
    )


def run_dcp(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp

    init_fresh_group()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(64, 64))
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    blob = Blob(args.mib, rank)
    start = 0
    latest = os.path.join(args.ckpt, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            saved = int(f.read())
        path = os.path.join(args.ckpt, f"step-{saved}")
        drop_cache(path)  # only a restart finds a checkpoint here
        state = _dcp_state(model, blob, rank)
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        start = saved + 1
    for step in range(start, args.steps):
        step_once(model, optim)
        dcp.save(
            _dcp_state(model, blob, rank), checkpoint_id=os.path.join(args.ckpt, f"step-{step}")
        )
        dist.barrier()
        if rank == 0:
            with open(latest + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(latest + ".tmp", latest)
            shutil.rmtree(os.path.join(args.ckpt, f"step-{step - 2}"), ignore_errors=True)
        record(args.out, step)
        time.sleep(args.sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", choices=("peerckpt", "dcp"), required=True)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--ckpt", default="")
    args = parser.parse_args()
    (run_peerckpt if args.mode == "peerckpt" else run_dcp)(args)
