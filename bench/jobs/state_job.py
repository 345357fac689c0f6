"""A job whose whole state is a big DTensor model, for the resharding benchmark.

usage: state_job.py OUT_DIR [--mib-per-rank M] [--tensors T] [--steps N] [--sleep S] [--work K]

The model holds T frozen float32 parameters, each a DTensor ``Shard(0)`` over all ranks, of
M MiB per rank in total at the starting world size (``--world``). Their bit patterns are
their global element indices (an int32 arange viewed as float32), so a restore into any
layout can be checked exactly without gathering. After a restore, every rank appends
``{"epoch", "rank", "world", "restored", "track_s", "nbytes", "exact"}`` to
OUT_DIR/restored.jsonl, where ``track_s`` is the time ``ctx.track`` took (the whole
resharding restore: wants, plan, transfers, copy into place); then the job runs two more
steps and ends. Each step does ``--work`` matmuls (one thread) and sleeps ``--sleep``;
its wall-clock span goes to OUT_DIR/steps-rank<r>.jsonl.
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import peerckpt

COLS = 1024


def rows_per_tensor(args: argparse.Namespace) -> int:
    total = args.mib_per_rank * args.world << 20
    rows = total // (args.tensors * COLS * 4)
    return rows - rows % 12  # divisible by 4, 3 and 2: even shards on any world up to 4


def pattern(tensor_index: int, row0: int, rows: int, total_rows: int) -> torch.Tensor:
    start = (tensor_index * total_rows + row0) * COLS
    return torch.arange(start, start + rows * COLS, dtype=torch.int32).view(torch.float32)


def run(ctx: peerckpt.Context, args: argparse.Namespace) -> None:
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
    ctx.track(model=model)
    track_s = time.perf_counter() - start
    if ctx.restored_step is not None:
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
            "nbytes": local_rows * COLS * 4 * args.tensors,
            "exact": exact,
        }
        with open(os.path.join(args.out, "restored.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
    torch.set_num_threads(1)
    a = torch.randn(384, 384, generator=torch.Generator().manual_seed(rank))
    log = open(os.path.join(args.out, f"steps-rank{rank}.jsonl"), "a")  # noqa: SIM115
    for step in ctx.steps(args.steps):
        if ctx.restored_step is not None and step > ctx.restored_step + 2:
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mib-per-rank", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--world", type=int, default=4, help="the starting world size")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sleep", type=float, default=0.2)
    parser.add_argument("--work", type=int, default=0, help="matmuls per step")
    args = parser.parse_args()
    peerckpt.resilient()(run)(args)
