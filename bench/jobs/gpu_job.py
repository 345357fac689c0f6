"""A CUDA training loop for the GPU stall benchmark: an MLP whose parameters and AdamW state
together hold about ``--mib`` MiB, one snapshot per step.

usage: gpu_job.py OUT_DIR --mib M --batch B [--steps N] [--plain]

With ``--plain`` the same loop runs without peerckpt (the baseline). Each step ends with
``loss.item()`` (the usual per-step sync); its wall-clock time goes to
OUT_DIR/steps-<plain|peerckpt>.json, with the engine's stall time when peerckpt runs.
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
from train_job import build as build_cpu
from train_job import train_step


def build(mib: int) -> nn.Module:
    """The stall benchmark's MLP (``train_job.build``), on the GPU."""
    return build_cpu(mib).cuda()


def loop(model, optim, x, steps, step_iter) -> list[float]:
    times = []
    last = time.perf_counter()
    for _ in step_iter:
        train_step(model, optim, x)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mib", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(args.mib)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    hidden = model[0].in_features
    x = torch.randn(args.batch, hidden, device="cuda", generator=None)
    if args.plain:
        times = loop(model, optim, x, args.steps, range(args.steps))
        result = {"times": times}
        name = "plain"
    else:
        import peerckpt

        @peerckpt.resilient(every=1)  # the GPU path snapshots every step
        def train(ctx: peerckpt.Context) -> dict:
            ctx.track(model=model, optim=optim)
            times = loop(model, optim, x, args.steps, ctx.steps(args.steps))
            engine = ctx._tracking.engine  # the stall the optimizer pre-hook measured
            return {"times": times, "stall_s": engine.stall_s}

        result = train()
        name = "peerckpt"
    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    result.update(state_bytes=nbytes, batch=args.batch, hidden=hidden)
    with open(os.path.join(args.out, f"steps-{name}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
