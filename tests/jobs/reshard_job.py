"""Jobs whose layout depends on the world size, for the resharding tests.

usage: reshard_job.py OUT_DIR --kind dtensor|fsdp|fsdp-app|flat [--steps N] [--sleep S] [--hidden H]

- dtensor: a 12×10 DTensor parameter, Shard(0) over 4 ranks and Shard(1) over any other
  number, plus a replicated bias; AdamW.
- fsdp: a small MLP under FSDP2 (fully_shard over all ranks); AdamW.
- fsdp-app: the same, tracked as the DCP tutorial does: one ``AppState`` whose
  ``state_dict()`` is torch's ``get_state_dict(model, optim)`` (DTensors keyed by FQN).
- flat: three tensors flattened and concatenated, cut at irregular offsets that depend on
  the world size (peerckpt.FlatShard), updated elementwise every step.

Rank 0 appends ``{"epoch", "world", "step", "digest"}`` of the *full* state — every shard
gathered — after every step to OUT_DIR/full.jsonl, and the same for the state it restored
(``"restored": step``) to OUT_DIR/restored.jsonl.
"""

import argparse
import hashlib
import itertools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from user_loop import AppState  # the DCP tutorial's Stateful over get/set_state_dict

import peerckpt

SHAPES = {"a": (5, 7), "b": (13,), "c": (3, 4, 2)}


def boundaries(world: int) -> list[int]:
    """Irregular cut points of the flat buffer (72 elements) for ``world`` ranks."""
    total = sum(math.prod(s) for s in SHAPES.values())
    cuts = [0] + [min(total, (i * total) // world + (3 if i % 2 else -2)) for i in range(1, world)]
    return [*cuts, total]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(full(t).detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class DModel(nn.Module):
    def __init__(self, world: int) -> None:
        super().__init__()
        mesh = init_device_mesh("cpu", (world,))
        placement = Shard(0) if world == 4 else Shard(1)
        torch.manual_seed(0)
        self.w = nn.Parameter(distribute_tensor(torch.randn(12, 10), mesh, [placement]))
        self.b = nn.Parameter(distribute_tensor(torch.zeros(10), mesh, [Replicate()]))
        self.mesh, self.placement = mesh, placement

    def loss(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        x = distribute_tensor(torch.randn(12, 10, generator=g), self.mesh, [self.placement])
        return (self.w * self.w).sum() * 0.5 + (self.w * x).sum() + (self.b * self.b).sum()


def state_tensors(model: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p for _, p in sorted(model.named_parameters())]
    for p in out[:]:
        for _, v in sorted(optim.state[p].items()):
            out.append(v if isinstance(v, torch.Tensor) else torch.tensor(float(v)))
    return out


def run(ctx: peerckpt.Context, args: argparse.Namespace) -> None:
    world, rank = ctx.world_size, ctx.rank
    if args.kind == "flat":
        cuts = boundaries(world)
        start, stop = cuts[rank], cuts[rank + 1]
        total = cuts[-1]
        local = torch.zeros(stop - start)
        ctx.track(flat=peerckpt.FlatShard(local, SHAPES, start, stop))

        def state() -> list[torch.Tensor]:
            width = max(b - a for a, b in itertools.pairwise(cuts))
            padded = torch.zeros(width)
            padded[: stop - start] = local
            parts = [torch.zeros(width) for _ in range(world)]
            dist.all_gather(parts, padded)
            return [torch.cat([parts[r][: cuts[r + 1] - cuts[r]] for r in range(world)])]

        def step_fn(step: int) -> None:
            index = torch.arange(start, stop, dtype=torch.float32)
            local.mul_(0.9).add_(torch.sin(index * 0.1 + step))
            assert stop <= total
    else:
        if args.kind == "dtensor":
            model = DModel(world)
        else:
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            torch.manual_seed(0)
            hidden = args.hidden
            model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 8))
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if args.kind == "fsdp-app":
            ctx.track(app=AppState(model, optim))
        else:
            ctx.track(model=model, optim=optim)

        def state() -> list[torch.Tensor]:
            return state_tensors(model, optim)

        def step_fn(step: int) -> None:
            if args.kind == "dtensor":
                loss = model.loss(step)
            else:
                g = torch.Generator().manual_seed(1000 * step + rank)
                loss = model(torch.randn(4, 16, generator=g)).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()

    def record(name: str, **fields: object) -> None:
        d = digest(state())  # collective: every rank gathers
        if rank == 0:
            with open(os.path.join(args.out, name), "a") as f:
                f.write(
                    json.dumps({"epoch": ctx.epoch, "world": world, "digest": d, **fields}) + "\n"
                )

    if ctx.restored_step is not None:
        record("restored.jsonl", restored=ctx.restored_step)
    for step in ctx.steps(args.steps):
        step_fn(step)
        record("full.jsonl", step=step)
        if args.sleep:
            time.sleep(args.sleep)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kind", choices=["dtensor", "fsdp", "fsdp-app", "flat"], required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.0)
    # fsdp: the MLP's hidden width (bench/erasure.py sizes the job's state with it)
    parser.add_argument("--hidden", type=int, default=32)
    args = parser.parse_args()
    peerckpt.resilient(every=1)(run)(args)  # the tests kill at given steps
