"""A short job that records what its ranks see of the environment.

usage: env_job.py OUT_DIR NAME...
Each rank writes OUT_DIR/env<rank>.json: ``{"node", "values": {NAME: value or null}}``, then
trains a tiny model for a few steps (so that the job is an ordinary, protected one).
"""

import json
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel

import peerckpt


@peerckpt.resilient()
def train(ctx: peerckpt.Context, out: str, names: list[str]) -> None:
    record = {
        "node": ctx.node,
        "values": {name: os.environ.get(name) for name in names},
        "hash": hash("peerckpt"),
    }
    with open(os.path.join(out, f"env{ctx.rank}.json"), "w") as f:
        json.dump(record, f)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model=model, optim=optim)
    for _ in ctx.steps(5):
        model(torch.ones(2, 4)).sum().backward()
        optim.step()
        optim.zero_grad()


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2:])
