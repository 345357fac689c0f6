"""Train a small byte-level transformer language model on Python's own standard library.

usage: train_lm.py OUT_DIR [--steps N] [--corpus-bytes B] [--lr LR]

The corpus is the first B bytes of the standard library's top-level .py files, in sorted
order, so every run and every rank sees the same text; each rank reads its own contiguous
part of it. The job uses DDP, AdamW and dropout, and survives the loss of ranks and nodes
through peerckpt. Each rank appends one line per step, ``{"step", "epoch", "loss",
"digest", "time"}`` (digest: sha256 of the model and optimizer state), to
OUT_DIR/rank<r>.jsonl; at the end rank 0 writes OUT_DIR/final.json with the final digest
and the loss at the first and last step it ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import peerckpt

VOCAB = 256  # bytes
CONTEXT = 64
BATCH = 8

# What rank 0 saw, across re-executions of ``train`` after failures: (step, loss).
_seen: dict[str, tuple[int, float]] = {}


def load_corpus(nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of the standard library's top-level .py files, sorted by name."""
    stdlib = os.path.dirname(os.__file__)
    chunks, size = [], 0
    for name in sorted(os.listdir(stdlib)):
        if name.endswith(".py") and size < nbytes:
            with open(os.path.join(stdlib, name), "rb") as f:
                chunks.append(f.read(nbytes - size))
            size += len(chunks[-1])
    data = b"".join(chunks)
    if len(data) < nbytes:
        raise SystemExit(f"the standard library has only {len(data)} bytes of .py; lower B")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class ShardLoader:
    """This rank's part of the corpus as ``batch`` parallel streams, read ``context`` bytes
    at a time; resumable through ``state_dict``."""

    def __init__(self, corpus: torch.Tensor, rank: int, world_size: int) -> None:
        shard = len(corpus) // world_size
        rows = corpus[rank * shard : (rank + 1) * shard]
        row_len = shard // BATCH
        self.rows = rows[: row_len * BATCH].view(BATCH, row_len)
        self.pos, self.passes = 0, 0

    def next(self) -> torch.Tensor:
        """A ``(batch, context + 1)`` block: inputs and, shifted by one, targets."""
        if self.pos + CONTEXT + 1 > self.rows.shape[1]:
            self.pos, self.passes = 0, self.passes + 1
        block = self.rows[:, self.pos : self.pos + CONTEXT + 1]
        self.pos += CONTEXT
        return block

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos, self.passes = state["pos"], state["passes"]


class Block(nn.Module):
    """A pre-norm causal transformer block; dropout on the two residual branches only,
    where it is cheapest (dropout's random draws dominate a CPU step of a model this small)."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ff = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.ff(self.ln2(x)))


class TinyLM(nn.Module):
    """A causal transformer over bytes: embeddings, a few blocks, a linear head."""

    def __init__(self, d_model: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(CONTEXT, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads, dropout=0.1) for _ in range(layers)))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        return self.head(self.norm(self.blocks(h)))


def digest(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    """sha256 of every tensor of the model and the optimizer state, in a fixed order."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.numpy().tobytes())
    for state in optim.state_dict()["state"].values():
        for v in state.values():
            h.update(v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()


@peerckpt.resilient()
def train(ctx: peerckpt.Context, out: str, steps: int, corpus_bytes: int, lr: float) -> str:
    torch.manual_seed(0)  # every rank builds the same model
    model = DistributedDataParallel(TinyLM())
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    data = ShardLoader(load_corpus(corpus_bytes), ctx.rank, ctx.world_size)
    ctx.track(model=model, optim=optim, data=data)
    with open(os.path.join(out, f"rank{ctx.rank}.jsonl"), "a") as log:
        for step in ctx.steps(steps):
            block = data.next()
            logits = model(block[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), block[:, 1:].reshape(-1))
            loss.backward()
            optim.step()
            optim.zero_grad()
            record: dict[str, Any] = {"step": step, "epoch": ctx.epoch, "loss": loss.item()}
            record.update(digest=digest(model, optim), time=time.time())
            log.write(json.dumps(record) + "\n")
            log.flush()  # a whole line per write(2), so a killed rank leaves no half line
            if ctx.rank == 0:
                _seen.setdefault("first", (step, loss.item()))
                _seen["last"] = (step, loss.item())
    return digest(model, optim)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="directory for the per-rank step records")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--corpus-bytes", type=int, default=1 << 20)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    final = train(args.out, args.steps, args.corpus_bytes, args.lr)
    if int(os.environ["RANK"]) == 0:
        first, last = _seen["first"], _seen["last"]
        with open(os.path.join(args.out, "final.json"), "w") as f:
            json.dump(
                {
                    "digest": final,
                    "first_step": first[0],
                    "first_loss": first[1],
                    "last_step": last[0],
                    "last_loss": last[1],
                },
                f,
            )
