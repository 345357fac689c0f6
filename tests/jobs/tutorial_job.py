"""A script written the way the PyTorch DDP tutorial's multi-GPU Trainer is, then decorated:
it keeps ``init_process_group``/``destroy_process_group`` (imported by name at the top, as
the tutorial does), is seeded once at program start, builds a random synthetic dataset in its
setup (drawn from the global RNG, after the process group is set up), and reads batches from
a torchdata StatefulDataLoader over a DistributedSampler.

With ``--epoch-steps N`` its loop is the one of PyTorch's "Writing Distributed Applications"
tutorial ported onto ``ctx.steps``: a shuffling loader over the rank's partition, dropout in
the model, and a new iterator made inside the loop at each data epoch's first step
(``if step % N == 0: batches = iter(loader)``), which a restore resuming mid-epoch must make
again (``runtime/carried.py``).

usage: tutorial_job.py OUT_DIR [--steps N] [--sleep S] [--epoch-steps N]
Each rank appends ``{"step", "epoch", "digest"}`` lines to OUT_DIR/rank<r>.jsonl; rank 0
writes OUT_DIR/final.json.
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from ddp_job import digest  # sha256 of the model's and the optimizer's state
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import peerckpt

torch.manual_seed(0)  # once, at program start, as the tutorial's users do


class MyTrainDataset(Dataset):
    """The tutorial's: random pairs, made when the trainer is set up."""

    def __init__(self, size: int) -> None:
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]


def ddp_setup() -> None:
    init_process_group(backend="gloo")


@peerckpt.resilient()
def main(ctx: peerckpt.Context, steps: int, out: str, sleep: float, epoch_steps: int) -> str:
    ddp_setup()
    dataset = MyTrainDataset(4096)  # draws from the global RNG: the same on every entry
    dropout = torch.nn.Dropout(0.2) if epoch_steps else torch.nn.Identity()
    model = DDP(
        torch.nn.Sequential(
            torch.nn.Linear(20, 64), torch.nn.ReLU(), dropout, torch.nn.Linear(64, 1)
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    if epoch_steps:  # the dist tutorial's partition of the data, shuffled by the loader
        share = torch.utils.data.Subset(dataset, range(ctx.rank, len(dataset), ctx.world_size))
        loader = StatefulDataLoader(share, batch_size=32, shuffle=True)
    else:
        loader = StatefulDataLoader(
            dataset,
            batch_size=32,
            shuffle=False,
            sampler=DistributedSampler(dataset),
            num_workers=1,
        )
    ctx.track(model=model, optim=optimizer, data=loader)
    if not epoch_steps:
        batches = iter(loader)
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as log:
        for step in ctx.steps(steps):
            if epoch_steps and step % epoch_steps == 0:
                batches = iter(loader)  # draws its shuffle's seed from torch's generator
            source, targets = next(batches)
            optimizer.zero_grad()
            loss = F.mse_loss(model(source), targets)
            loss.backward()
            optimizer.step()
            log.write(
                json.dumps({"step": step, "epoch": ctx.epoch, "digest": digest(model, optimizer)})
                + "\n"
            )
            log.flush()
            time.sleep(sleep)
    result = digest(model, optimizer)
    destroy_process_group()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--epoch-steps", type=int, default=0)
    args = parser.parse_args()
    final = main(args.steps, args.out, args.sleep, args.epoch_steps)
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(args.out, "final.json"), "w") as f:
            json.dump({"digest": final}, f)
