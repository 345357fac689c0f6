"""A script shaped like karpathy/nanoGPT's ``train.py``, decorated the way README.md says:
everything nanoGPT does at its top level stays there — the config, DDP detected from
``RANK`` in the environment, ``init_process_group`` called before any function runs, the
rank, local rank and world size read from the environment, ``seed_offset = ddp_rank``,
``gradient_accumulation_steps //= ddp_world_size``, ``torch.manual_seed(1337 + seed_offset)``,
the data as a NumPy memmap made here — and the loop over ``ctx.steps`` is the decorated
function (under a tqdm-shaped progress wrapper; ``get_batch`` with ``torch.randint``, the first batch
fetched before the loop and each next one prefetched in the step, accumulation under ``require_backward_grad_sync``,
``get_lr`` setting each group's lr, gradient clipping).

usage: nanogpt_job.py OUT_DIR [--steps N] [--sleep S] [--top-s S]
Each rank appends ``{"step", "epoch", "digest", "pid", "top_rank"}`` lines to
OUT_DIR/rank<r>.jsonl (``top_rank``: the RANK the top level read); rank 0 writes
OUT_DIR/final.json.
"""

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from ddp_job import digest  # sha256 of the model's and the optimizer's state
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import peerckpt

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--top-s", type=float, default=0.0, help="top-level work after the import")
args = parser.parse_args()
time.sleep(args.top_s)  # stands for top-level work after `import peerckpt` (a dataset built)

# -- nanoGPT's config and DDP setup, at the top level -------------------------------------
gradient_accumulation_steps = 4
batch_size, block_size, vocab = 4, 16, 64
learning_rate, min_lr, warmup_iters = 1e-3, 1e-4, 5
grad_clip = 1.0
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size, ddp_rank = True, 0, 1, 0
torch.manual_seed(1337 + seed_offset)

data_path = os.path.join(args.out, f"train-{os.getpid()}.bin")
np.random.default_rng(0).integers(0, vocab, 20_000, dtype=np.uint16).tofile(data_path)
train_data = np.memmap(data_path, dtype=np.uint16, mode="r")


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(train_data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(train_data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack(
        [torch.from_numpy(train_data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix]
    )
    return x, y


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, 32)
        self.drop = nn.Dropout(0.1)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.lm_head = nn.Linear(32, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx))
        x = x + self.mlp(x)
        logits = self.lm_head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_lr(it: int, max_iters: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


class Progress:
    """tqdm's shape (its ``__iter__`` is a generator over the iterable, bar or no bar), as
    forks of nanoGPT wrap the loop: ``for it in tqdm(range(max_iters), disable=…)``. It
    iterates ``ctx.steps`` for the loop, whose carried batch must still be found."""

    def __init__(self, iterable: Any, disable: bool = False) -> None:
        self.iterable, self.disable, self.n = iterable, disable, 0

    def __iter__(self) -> Any:
        for obj in self.iterable:
            yield obj
            self.n += 1


@peerckpt.resilient()
def train(ctx: peerckpt.Context) -> str:
    model = TinyLM()
    if ddp:
        model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95))
    ctx.track(model=model, optim=optimizer)
    rank = int(os.environ["RANK"])
    X, Y = get_batch()  # fetch the very first batch
    with open(os.path.join(args.out, f"rank{rank}.jsonl"), "a") as log:
        for it in Progress(ctx.steps(args.steps), disable=not master_process):
            lr = get_lr(it, args.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for micro_step in range(gradient_accumulation_steps):
                if ddp:
                    model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
                loss = model(X, Y) / gradient_accumulation_steps
                # prefetch the next batch while the model computes, as nanoGPT does
                X, Y = get_batch()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            record = {"step": it, "epoch": ctx.epoch, "digest": digest(model, optimizer)}
            record.update(pid=os.getpid(), top_rank=ddp_rank)
            log.write(json.dumps(record) + "\n")
            log.flush()
            time.sleep(args.sleep)
    return digest(model, optimizer)


final = train()
os.unlink(data_path)
if master_process and int(os.environ["RANK"]) == 0:
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump({"digest": final}, f)
if ddp:
    destroy_process_group()
sys.exit(0)
