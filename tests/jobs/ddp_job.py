"""A small DDP job for the multi-process tests: a tiny transformer LM with dropout, AdamW,
a resumable data loader, and a record of the model+optimizer digest after every step.

usage: ddp_job.py OUT_DIR [--steps N] [--sleep S] [--slow-rank R --slow-s S]
                 [--raise-rank R --raise-at STEP] [--segfault-rank R --segfault-at STEP]
                 [--busy-rank R --busy-at STEP --busy-s S]
                 [--pg-timeout S]
                 [--stuck-rank R --stuck-at STEP --abort-grace S --abort-timeout S]
                 [--device cuda --backend gloo]
Each rank appends ``{"step", "epoch", "digest", "loss"}`` lines to OUT_DIR/rank<r>.jsonl and
rank 0 writes OUT_DIR/final.json at the end.
"""

import argparse
import ctypes
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import peerckpt


class Tokens:
    """Random tokens from a fixed seed, read in order; resumable through state_dict."""

    def __init__(self, rank: int, batch: int = 4, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(1234 + rank)
        self.data = torch.randint(0, 64, (4096,), generator=g)
        self.batch, self.seq, self.pos = batch, seq, 0

    def next(self) -> torch.Tensor:
        n = self.batch * (self.seq + 1)
        if self.pos + n > len(self.data):
            self.pos = 0
        x = self.data[self.pos : self.pos + n].view(self.batch, self.seq + 1)
        self.pos += n
        return x

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class SampledTokens:
    """A fixed dataset of token rows, batched by a ResumableSampler (resharded on a change)."""

    def __init__(self, n: int, rank: int, world: int, batch: int = 4) -> None:
        g = torch.Generator().manual_seed(99)
        self.rows = torch.randint(0, 64, (n, 17), generator=g)
        self.sampler = peerckpt.ResumableSampler(n, rank, world, seed=7)
        self.batch, self.last = batch, {}

    def next(self) -> torch.Tensor:
        indices = self.sampler.take(self.batch)
        self.last = {"data_epoch": self.sampler.epoch, "indices": indices}
        return self.rows[indices or [0]]  # a short share at an epoch's end: a harmless row

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def load_resharded_state(self, states: list, rank: int, world_size: int) -> None:
        self.sampler.load_resharded_state(states, rank, world_size)


def build() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True)
    return nn.Sequential(nn.Embedding(64, 32), nn.TransformerEncoder(layer, 2), nn.Linear(32, 64))


def digest(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.cpu().numpy().tobytes())
    for state in optim.state_dict()["state"].values():
        for v in state.values():
            h.update(v.cpu().numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()


def _hold_the_gil(seconds: float) -> None:
    """One C call that computes for about ``seconds`` without letting another thread run, as
    json.loads of a large annotation file does: sum() over a range, sized on a short one."""
    started = time.perf_counter()
    sum(range(2_000_000))
    rate = 2_000_000 / max(time.perf_counter() - started, 1e-6)
    sum(range(int(rate * seconds)))


def train(ctx: peerckpt.Context, args: argparse.Namespace) -> str:
    model = DistributedDataParallel(build().to(args.device))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Tokens(ctx.rank)
    if args.sampler:
        # Batches drawn from a ResumableSampler over a fixed dataset; what it hands out is
        # recorded, to check that no sample is lost or repeated across topology changes.
        data = SampledTokens(args.sampler, ctx.rank, ctx.world_size)
    ctx.track(model=model, optim=optim, data=data)
    if ctx.restored_step is not None:  # what was restored, to compare with the committed step
        with open(os.path.join(args.out, "restored.jsonl"), "a") as f:
            f.write(
                json.dumps(
                    {
                        "epoch": ctx.epoch,
                        "rank": ctx.rank,
                        "world": ctx.world_size,
                        "step": ctx.restored_step,
                        "digest": digest(model, optim),
                    }
                )
                + "\n"
            )
    with open(os.path.join(args.out, f"rank{ctx.rank}.jsonl"), "a") as log:
        run_steps(ctx, model, optim, data, log, args)
    if args.second_loop:
        for _ in ctx.steps(2):  # a second phase as a loop of its own: refused
            pass
    return digest(model, optim)


def run_steps(ctx, model, optim, data, log, args) -> None:
    grown_at = None
    for step in ctx.steps(args.steps):
        if (
            args.until_world
            and ctx.world_size == args.until_world
            and ctx.restored_step is not None
        ):
            # Wait for a joining node, however long it takes to start; then a few more steps.
            grown_at = step if grown_at is None else grown_at
            if step >= grown_at + args.after:
                break
        if step == args.pause_at:
            time.sleep(args.pause_s)  # every rank: nothing commits meanwhile
        x = data.next().to(args.device)
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), x[:, 1:].reshape(-1))
        if ctx.rank == args.slow_rank:
            time.sleep(args.slow_s)  # the other ranks wait for us inside the all-reduce
        if ctx.rank == args.stuck_rank and step == args.stuck_at and ctx.epoch == 0:
            time.sleep(600)  # stands for a collective that aborting the epoch does not release
        if ctx.rank == args.raise_rank and step == args.raise_at:
            raise ValueError(f"injected failure at step {step}")
        if ctx.rank == args.segfault_rank and step == args.segfault_at:
            ctypes.string_at(0)  # a bug in native code: every time this step is reached
        if ctx.rank == args.busy_rank and step == args.busy_at and ctx.epoch == 0:
            _hold_the_gil(args.busy_s)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if ctx.rank == args.skew_rank:  # its parameters now differ from its DDP twins'
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
        log.write(
            json.dumps(
                {
                    "step": step,
                    "epoch": ctx.epoch,
                    "digest": digest(model, optim),
                    "loss": loss.item(),
                    "world": ctx.world_size,
                    **getattr(data, "last", {}),
                }
            )
            + "\n"
        )
        log.flush()
        if args.sleep:
            time.sleep(args.sleep)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--second-loop", action="store_true", help="loop over ctx.steps again")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--raise-rank", type=int, default=-1)
    parser.add_argument("--raise-at", type=int, default=-1)
    parser.add_argument("--segfault-rank", type=int, default=-1)
    parser.add_argument("--segfault-at", type=int, default=-1)
    parser.add_argument("--busy-rank", type=int, default=-1, help="holds the GIL, computing")
    parser.add_argument("--busy-at", type=int, default=-1)
    parser.add_argument("--busy-s", type=float, default=0.0)
    parser.add_argument("--pg-timeout", type=float, default=1800.0)
    parser.add_argument(
        "--stuck-rank", type=int, default=-1, help="never leaves --stuck-at in epoch 0"
    )
    parser.add_argument("--stuck-at", type=int, default=-1)
    parser.add_argument("--abort-grace", type=float, default=10.0)
    parser.add_argument("--abort-timeout", type=float, default=30.0)
    parser.add_argument("--sampler", type=int, default=0, help="draw batches from N samples")
    parser.add_argument(
        "--until-world",
        type=int,
        default=0,
        help="once restored into a world this big, stop after --after steps",
    )
    parser.add_argument("--after", type=int, default=5)
    parser.add_argument("--pause-at", type=int, default=-1, help="every rank sleeps at this step")
    parser.add_argument("--pause-s", type=float, default=0.0)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: every rank on cuda:0")
    parser.add_argument("--backend", default=None, help="the process groups' backend")
    parser.add_argument("--every", type=int, default=1, help="resilient(every=N)")
    parser.add_argument("--overhead", type=float, default=None, help="resilient(overhead=F)")
    parser.add_argument("--no-dedup", action="store_true", help="resilient(dedup=False)")
    parser.add_argument(
        "--skew-rank", type=int, default=-1, help="nudges its parameters after every step"
    )
    parser.add_argument("--persist", default=None, help="resilient(persist=URL)")
    parser.add_argument("--erasure", default=None, help='resilient(erasure="K+M")')
    parser.add_argument(
        "--fail-after", type=int, default=-1, help="this rank raises after the function returns"
    )
    parser.add_argument(
        "--script-collectives",
        action="store_true",
        help="init_process_group and get_rank before the function, an all_reduce after it",
    )
    args = parser.parse_args()
    if args.device != "cpu":
        # Bit-exact runs on a GPU: deterministic kernels, and attention through the math path.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    resilient = peerckpt.resilient(
        pg_timeout_s=args.pg_timeout,
        backend=args.backend,
        abort_grace_s=args.abort_grace,
        abort_timeout_s=args.abort_timeout,
        # The chaos tests kill at given steps: a snapshot after every step unless asked
        every=None if args.overhead is not None else args.every,
        overhead=args.overhead or 0.05,
        dedup=not args.no_dedup,
        persist=args.persist,
        erasure=args.erasure,
    )
    if args.script_collectives:  # as Lightning Fabric's launch() does at the top level
        dist.init_process_group("gloo")
        top = (dist.get_rank(), dist.get_world_size())
    final = resilient(train)(args)
    if args.script_collectives:  # an evaluation's metrics, reduced after training
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total)
        dist.barrier()
        with open(os.path.join(args.out, f"after.r{dist.get_rank()}.json"), "w") as f:
            json.dump({"top": top, "sum": total.item()}, f)
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(args.out, "final.json"), "w") as f:
            json.dump({"digest": final}, f)
    if int(os.environ["RANK"]) == args.fail_after:
        time.sleep(1.0)  # after the job's end reached every process
        raise RuntimeError("the evaluation after training failed")
