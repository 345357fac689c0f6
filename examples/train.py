"""A training script to start from: DDP, AdamW, a cosine LR schedule, and torchdata's
StatefulDataLoader over a DistributedSampler, made to survive lost ranks and nodes.

    peerckpt run --nodes 2 --nproc-per-node 2 --spares 2 examples/train.py --steps 200
    peerckpt run --nodes 2 --nproc-per-node 2 --spares 2 \\
        --chaos "kill rank=2 at=60; kill node=1 at=120" examples/train.py --steps 200

What makes it resilient is four lines: ``@peerckpt.resilient()`` on the training function,
which is called again after a failure, in the same process, with a fresh ``ctx`` for the new
topology; ``ctx.track(...)`` naming every object whose state the loop changes (it restores
them there after a failure); ``ctx.steps(n)`` as the loop (it resumes after the restored
step, and snapshots as it goes); and everything built from ``ctx`` (rank, world size), not
from the environment. The rest is a plain DDP script, less ``init_process_group``: peerckpt
forms the process group for each epoch of the job (which the loss of a rank ends).

The data is a synthetic classification task, generated at program start from the seed set
there: every process, a spare started later too, builds the same one.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import peerckpt

FEATURES, CLASSES = 32, 8


def synthetic_dataset(rows: int) -> TensorDataset:
    """Points labelled by a fixed random linear map: a task a small MLP learns in a few
    hundred steps."""
    x = torch.randn(rows, FEATURES)
    labels = (x @ torch.randn(FEATURES, CLASSES)).argmax(dim=1)
    return TensorDataset(x, labels)


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, CLASSES)
    )


@peerckpt.resilient()
def train(ctx: peerckpt.Context, data: TensorDataset, args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", ctx.local_rank) if cuda else torch.device("cpu")
    model = DDP(build_model().to(device), device_ids=[device.index] if cuda else None)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    # Built for the current topology: after a node is lost or added, ctx.world_size differs.
    sampler = DistributedSampler(data, ctx.world_size, ctx.rank, shuffle=True, seed=0)
    loader = StatefulDataLoader(
        data, batch_size=args.batch, sampler=sampler, num_workers=args.workers
    )
    ctx.track(model=model, optim=optim, sched=sched, data=loader)  # restored here
    per_epoch = len(loader)  # batches in a pass over this rank's share of the data
    first = 0 if ctx.restored_step is None else ctx.restored_step + 1
    sampler.set_epoch(first // per_epoch)  # the data epoch's order, the same on every rank
    # Before ctx.steps, which restores the RNG states: creating the iterator draws from them.
    batches = iter(loader)  # where the restored state left off
    for step in ctx.steps(args.steps):  # starts after the restored step
        batch = next(batches, None)
        if batch is None:  # the data epoch ended: the next one, in a new order
            sampler.set_epoch(step // per_epoch)
            batches = iter(loader)
            batch = next(batches)
        x, y = (t.to(device) for t in batch)
        loss = nn.functional.cross_entropy(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        if ctx.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f}, lr {sched.get_last_lr()[0]:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rows", type=int, default=4096, help="the dataset's size")
    parser.add_argument("--workers", type=int, default=2, help="data-loading processes")
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)  # once, at program start
    train(synthetic_dataset(args.rows), args)


if __name__ == "__main__":
    main()
