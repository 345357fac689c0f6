"""A user's small DDP job under the default overhead budget (``@peerckpt.resilient()``): the
job whose snapshot interval ``bench/cadence.py`` reads, run after run.

usage: cadence_job.py OUT_DIR [--steps N]

An MLP of about 1.4 MB of parameters and SGD-with-momentum state per rank, seeded once at
program start, as the PyTorch DDP tutorial's trainer is; rank 0 writes the final parameters'
digest to OUT_DIR/final.txt.
"""

import argparse
import hashlib
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import peerckpt

torch.manual_seed(0)


class Batches:
    def __init__(self, rank: int) -> None:
        g = torch.Generator().manual_seed(100 + rank)
        self.x, self.y = torch.randn(4096, 20, generator=g), torch.randn(4096, 1, generator=g)
        self.pos = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.x[self.pos : self.pos + 32], self.y[self.pos : self.pos + 32]
        self.pos = (self.pos + 32) % 4096
        return batch

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


@peerckpt.resilient()
def train(ctx: peerckpt.Context, steps: int) -> str:
    model = DDP(
        nn.Sequential(
            nn.Linear(20, 256), nn.ReLU(), nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1)
        )
    )
    optim = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    data = Batches(ctx.rank)
    ctx.track(model=model, optim=optim, data=data)
    for _ in ctx.steps(steps):
        x, y = data.next()
        loss = F.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    digest = train(args.steps)
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(args.out, "final.txt"), "w") as f:
            f.write(digest)
