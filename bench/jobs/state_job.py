"""A job whose whole state is a big DTensor model, for the resharding, recovery and flush
benchmarks.

usage: state_job.py OUT_DIR [--mib-per-rank M] [--tensors T] [--steps N] [--sleep S] [--work K]

The model holds T frozen float32 parameters, each a DTensor ``Shard(0)`` over all ranks, of
M MiB per rank in total at the starting world size (``--world``). Their bit patterns are
their global element indices (an int32 arange viewed as float32), so a restore into any
layout can be checked exactly without gathering. After a restore the job runs ``--after``
more steps (2), then every rank appends ``{"epoch", "rank", "world", "restored", "track_s",
"entered_at", "tracked_at", "nbytes", "exact"}`` to OUT_DIR/restored.jsonl (the check comes
after the steps, so that it is not part of the time to resume) and the job ends.
``track_s`` is the time ``ctx.track`` took (the whole restore: for a resharding, wants, plan,
transfers, copy into place); ``entered_at`` and ``tracked_at`` are the wall-clock times at
which the function was entered (the new epoch's process group formed) and ``ctx.track``
returned. Each step does ``--work`` matmuls (one thread) and sleeps ``--sleep``; its
wall-clock span goes to OUT_DIR/steps-rank<r>.jsonl.
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
from state_layout import COLS, pattern, rows_per_tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import peerckpt


def profile_track(ctx: peerckpt.Context, model: nn.Module, path: str) -> None:
    """``ctx.track`` under cProfile; the 25 most expensive calls (cumulative) go to ``path``."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        ctx.track(model=model)
    finally:
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        with open(path, "w") as f:
            f.write(out.getvalue())


def run(ctx: peerckpt.Context, args: argparse.Namespace) -> None:
    entered_at = time.time()
    world, rank = ctx.world_size, ctx.rank
    mesh = init_device_mesh("cpu", (world,))
    total_rows = rows_per_tensor(args)
    local_rows = total_rows // world
    row0 = rank * local_rows
    model = nn.Module()
    restoring = ctx.restored_step is not None or ctx.epoch > 0
    for i in range(args.tensors):
        if restoring:
            local = torch.empty(local_rows * COLS, dtype=torch.float32)
        else:
            local = pattern(i, row0, local_rows, total_rows)
        dt = DTensor.from_local(local.view(local_rows, COLS), mesh, [Shard(0)], run_check=False)
        model.register_parameter(f"w{i}", nn.Parameter(dt, requires_grad=False))
    start = time.perf_counter()
    if args.profile_restore and ctx.restored_step is not None:
        profile_track(ctx, model, os.path.join(args.out, f"profile-e{ctx.epoch}-rank{rank}.txt"))
    else:
        ctx.track(model=model)
    track_s = time.perf_counter() - start
    tracked_at = time.time()
    torch.set_num_threads(1)
    a = torch.randn(384, 384, generator=torch.Generator().manual_seed(rank))
    log = open(os.path.join(args.out, f"steps-rank{rank}.jsonl"), "a")  # noqa: SIM115
    for step in ctx.steps(args.steps):
        if ctx.restored_step is not None and step > ctx.restored_step + args.after:
            break
        t0 = time.time()
        b = a
        for _ in range(args.work):  # a fixed amount of compute per step, like a training step
            b = torch.tanh(b @ a)
        time.sleep(args.sleep)
        log.write(json.dumps({"step": step, "epoch": ctx.epoch, "t0": t0, "t1": time.time()}))
        log.write("\n")
        log.flush()
    log.close()
    if ctx.restored_step is not None:
        # Checked after the steps, so that the check is not part of the time to resume.
        exact = all(
            torch.equal(
                getattr(model, f"w{i}").to_local().reshape(-1).view(torch.int32),
                pattern(i, row0, local_rows, total_rows).view(torch.int32),
            )
            for i in range(args.tensors)
        )
        line = {
            "epoch": ctx.epoch,
            "rank": rank,
            "world": world,
            "restored": ctx.restored_step,
            "track_s": track_s,
            "entered_at": entered_at,
            "tracked_at": tracked_at,
            "nbytes": local_rows * COLS * 4 * args.tensors,
            "exact": exact,
        }
        with open(os.path.join(args.out, "restored.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mib-per-rank", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--world", type=int, default=4, help="the starting world size")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sleep", type=float, default=0.2)
    parser.add_argument("--work", type=int, default=0, help="matmuls per step")
    parser.add_argument("--after", type=int, default=2, help="steps to run after a restore")
    parser.add_argument(
        "--profile-restore", action="store_true", help="cProfile ctx.track after a restore"
    )
    parser.add_argument("--every", type=int, default=1, help="snapshot every N steps")
    args = parser.parse_args()
    peerckpt.resilient(every=args.every)(run)(args)
