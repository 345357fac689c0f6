"""An ordinary DDP training script, for the time a failure costs (``bench/recovery.py``).

usage: cost_job.py OUT_DIR [--mib M] [--steps N] [--batch B] [--every N] [--overhead F]
                   [--mtbf S]

Each rank trains an MLP under DistributedDataParallel with fused AdamW; its parameters and
both moments hold about M MiB per rank (``train_job.build``). The script is what a user
writes: it builds the model and the optimizer in the function ``peerckpt.resilient`` calls
again after a failure, tracks them, and steps; the only concession to a restore is
``init_sync=False`` where a step is restored (DDP's broadcast of rank 0's freshly initialised
parameters would be overwritten at once).

Every step's wall-clock span goes to OUT_DIR/steps-rank<r>.jsonl (``epoch``, ``step``, ``t0``,
``t1``); after a restore each rank appends ``{"epoch", "rank", "restored", "entered_at",
"tracked_at"}`` to OUT_DIR/restored.jsonl; at the end every rank appends the snapshot interval
it used (and what it was chosen from, where this process measured it) to OUT_DIR/policy.jsonl,
and rank 0 writes the digest of its model and optimizer to OUT_DIR/final-e<epoch>.json (a
fault-free run's must equal it).
"""

import argparse
import dataclasses
import hashlib
import json
import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel
from train_job import build

import peerckpt


def digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().numpy().tobytes())
    for state in optim.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().numpy().tobytes())
    return h.hexdigest()


def run(ctx: peerckpt.Context, args: argparse.Namespace) -> None:
    entered_at = time.time()
    torch.set_num_threads(1)
    model = DistributedDataParallel(build(args.mib), init_sync=ctx.restored_step is None)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ctx.track(model=model, optim=optim)
    tracked_at = time.time()
    hidden = model.module[0].in_features
    log = open(os.path.join(args.out, f"steps-rank{ctx.rank}.jsonl"), "a")  # noqa: SIM115
    for step in ctx.steps(args.steps):
        t0 = time.time()
        g = torch.Generator().manual_seed(step * 1000 + ctx.rank)
        x = torch.randn(args.batch, hidden, generator=g)
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=False)
        log.write(json.dumps({"epoch": ctx.epoch, "step": step, "t0": t0, "t1": time.time()}))
        log.write("\n")
        log.flush()
    log.close()
    if ctx.restored_step is not None:
        line = {
            "epoch": ctx.epoch,
            "rank": ctx.rank,
            "restored": ctx.restored_step,
            "entered_at": entered_at,
            "tracked_at": tracked_at,
        }
        with open(os.path.join(args.out, "restored.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
    policy = ctx._tracking.policy  # the interval the ranks agreed on (runtime/policy.py)
    chosen = {
        "epoch": ctx.epoch,
        "rank": ctx.rank,
        "every": policy.every,  # agreed
        "interval": dataclasses.asdict(policy.interval) if policy.interval else None,  # local
    }
    with open(os.path.join(args.out, "policy.jsonl"), "a") as f:
        f.write(json.dumps(chosen) + "\n")
    if ctx.rank == 0:
        with open(os.path.join(args.out, f"final-e{ctx.epoch}.json"), "w") as f:
            json.dump({"digest": digest(model.module, optim)}, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--every", type=int, default=None, help="resilient(every=N)")
    parser.add_argument("--overhead", type=float, default=None, help="resilient(overhead=F)")
    parser.add_argument("--mtbf", type=float, default=None, help="resilient(mtbf=S)")
    args = parser.parse_args()
    resilient = peerckpt.resilient(every=args.every, overhead=args.overhead or 0.05, mtbf=args.mtbf)
    resilient(run)(args)
