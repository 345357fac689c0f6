"""A training script written the way users write them, with the pieces a matrix test picks.

usage: user_loop.py OUT_DIR [--steps N] [--patterns P,P,...|all] [--leave-out NAME,...]
                    [--record-workers] [--loop steps|range] [--sleep S] [--hold FILE]

Patterns (each a habit of ordinary training scripts; ``all`` is every one at once):

- ``inner-tracked``: ``ctx.track(model=net)``, then ``ddp = DDP(net)`` (the DDP never tracked);
- ``module-tracked``: ``ddp = DDP(net)`` first, then ``ctx.track(model=ddp.module)``;
- ``ddp-tracked``: ``ctx.track(model=ddp)`` (the default when none of the three is given);
- ``stateful-loader``: torchdata's ``StatefulDataLoader`` over a ``DistributedSampler`` with
  2 worker processes, tracked as ``data``;
- ``worker-random``: that loader's workers draw random numbers (torch, ``random``, numpy): a
  noise augmentation in the dataset's ``__getitem__`` and MLM-style masking in ``collate_fn``;
- ``resumable-sampler``: batches drawn by ``peerckpt.ResumableSampler``, tracked as ``sampler``;
- ``scaler``: ``torch.amp.GradScaler`` (tracked), its scale growing during the run;
- ``two-optimizers``: AdamW on the body and SGD with momentum on the head;
- ``lambdalr``: a ``LambdaLR`` schedule on the (first) optimizer;
- ``accumulation``: two micro-batches a step, the first under ``ddp.no_sync()``;
- ``batchnorm``: a ``BatchNorm1d`` layer (running statistics in its buffers);
- ``static-graph``: ``DDP(net, static_graph=True)``;
- ``app-state``: the DCP tutorial's ``AppState``, one Stateful holding the DDP and the
  optimizer(s) through torch's ``get_state_dict``/``set_state_dict``, tracked as ``app``;
- ``user-stateful``: a user object with ``state_dict``/``load_state_dict`` holding a tensor and
  a Python int, both changing every step;
- ``module-counter``: a module-level step counter the loop increments (``global seen_steps``),
  warming the loss up over the first 12 micro-batches, as older scripts keep ``global_step``;
- ``own-generator``: noise drawn from the script's own ``torch.Generator``, made before the
  loop (as diffusion-style objectives draw theirs);
- ``attribute-counter``: a step counter kept in an object's attribute (``state.seen += 1``, a
  class-based trainer's ``self.global_step``), scaling the loss as a warm-up;
- ``cycle-loader``: the StatefulDataLoader's batches drawn from a generator that cycles it
  (lucidrains' trainers: ``self.dl = cycle(dl)``, ``next(self.dl)`` in the step), so a restored
  process makes the loader's iterator inside its first step, resuming the data epoch there;
- ``prefetch`` (never in ``all``: with ``stateful-loader`` it is not exact after a restore):
  nanoGPT's batch fetched ahead, before the loop and again at the end of each step for the
  next one (the runtime saves and puts back the carried batch; from a loader, the code before
  the loop takes one batch more after a restore).

``--loop range`` iterates ``range(N)`` instead of ``ctx.steps(N)``, as a user who kept the
script's own loop would (no snapshot is ever taken); ``--sleep S`` sleeps S seconds a step;
``--hold FILE``: at step 3 every rank waits until FILE exists (a test acts on the job meanwhile).

``--leave-out`` names tracked objects (``sched``, ``data``, ``head_optim``, ``scaler``, …) that the
script then uses without passing them to ``ctx.track``, as a user who forgot them would.

Each rank appends ``{"step", "epoch", "digest", "loss"}`` to OUT_DIR/rank<r>.jsonl after every
step, the digest covering every tracked object; rank 0 writes OUT_DIR/final.json at the end.
With ``--record-workers`` each loader worker writes its pid to OUT_DIR/workers/<rank pid>-<pid>,
and every restored rank records in OUT_DIR/orphans.jsonl the workers whose rank process is gone
but which are still alive a second later.
"""

import argparse
import hashlib
import json
import os
import random
import time
import types
from contextlib import nullcontext

import numpy as np
import psutil
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DistributedSampler, TensorDataset, default_collate

import peerckpt

PATTERNS = (
    "inner-tracked",
    "module-tracked",
    "ddp-tracked",
    "stateful-loader",
    "worker-random",
    "resumable-sampler",
    "scaler",
    "two-optimizers",
    "lambdalr",
    "accumulation",
    "batchnorm",
    "user-stateful",
    "static-graph",
    "app-state",
    "prefetch",
    "module-counter",
    "own-generator",
    "attribute-counter",
    "cycle-loader",
)
EXACT = PATTERNS  # each recovers bit for bit on its own
BATCH = 8
ROWS = 4096
seen_steps = 0  # "module-counter": an older script's module-level step counter (``global``)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(ROWS, 16, generator=g)
    y = (x[:, :4].sum(dim=1) > 0).long() + 2 * (x[:, 4] > 0).long()
    return TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(16, 64),
            nn.BatchNorm1d(64) if batchnorm else nn.Identity(),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(64, 64),
            nn.ReLU(),
        )
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Augmented(Dataset):
    """Rows with noise drawn in the loader's worker process (torch, random and numpy)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        shift = random.random() + float(np.random.rand())
        return x + 0.1 * torch.randn(x.shape) + 0.01 * shift, y


def masked_collate(items: list) -> list:
    """default_collate, then a random 15 % of the features zeroed (MLM-style masking)."""
    x, y = default_collate(items)
    return [x.masked_fill(torch.rand(x.shape) < 0.15, 0.0), y]


class AppState:
    """As in the DCP tutorial: model and optimizer(s) saved through get/set_state_dict."""

    def __init__(self, model: nn.Module, optimizers: torch.optim.Optimizer | list) -> None:
        self.model, self.optimizers = model, optimizers

    def state_dict(self) -> dict:
        model, optim = get_state_dict(self.model, self.optimizers)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


class RunningStats:
    """What a user keeps beside the model: an average of the loss and a count of samples."""

    def __init__(self) -> None:
        self.loss_ema = torch.zeros(4)
        self.seen = 0

    def update(self, logits: torch.Tensor, n: int) -> None:
        self.loss_ema = 0.9 * self.loss_ema + 0.1 * logits.detach().mean(dim=0)
        self.seen += n

    def state_dict(self) -> dict:
        return {"loss_ema": self.loss_ema, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.loss_ema, self.seen = state["loss_ema"].clone(), state["seen"]


def _record_worker(worker_id: int) -> None:
    out = os.environ["USER_LOOP_WORKERS"]
    open(os.path.join(out, f"{os.getppid()}-{os.getpid()}"), "w").close()


def _orphans(folder: str) -> list[list[int]]:
    """[rank pid, worker pid] of loader workers alive although their rank process is gone."""
    found = []
    for name in os.listdir(folder):
        parent, worker = (int(p) for p in name.split("-"))
        if psutil.pid_exists(parent):
            continue
        try:
            if psutil.Process(worker).status() != psutil.STATUS_ZOMBIE:
                found.append([parent, worker])
        except psutil.NoSuchProcess:
            pass
    return found


def record_orphans(out: str, ctx: peerckpt.Context) -> None:
    """Loader workers that outlive their rank process by more than a second (torch's worker
    loop would notice the parent gone after 5 s): the first check, and the last."""
    folder = os.path.join(out, "workers")
    first = orphans = _orphans(folder)
    deadline = time.monotonic() + 1.0  # a SIGKILLed worker may wait for a core to die on
    while orphans and time.monotonic() < deadline:
        time.sleep(0.02)
        orphans = _orphans(folder)
    with open(os.path.join(out, "orphans.jsonl"), "a") as f:
        entry = {"epoch": ctx.epoch, "rank": ctx.rank, "orphans": orphans, "at_first": first}
        f.write(json.dumps(entry) + "\n")


def digest(objects: dict) -> str:
    h = hashlib.sha256()

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().numpy().tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                walk(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif not callable(value):
            h.update(repr(value).encode())

    for name in sorted(objects):
        walk(objects[name].state_dict())
    return h.hexdigest()


@peerckpt.resilient(every=1)  # the tests kill at given steps
def train(ctx: peerckpt.Context, args: argparse.Namespace) -> str:
    global seen_steps
    use = args.patterns
    net = Net(batchnorm="batchnorm" in use)
    wrap = {"static_graph": True} if "static-graph" in use else {}
    ddp = DDP(net, **wrap) if "inner-tracked" not in use else None
    tracked: dict = {}
    if "inner-tracked" in use:
        tracked["model"] = net
    elif "module-tracked" in use:
        tracked["model"] = ddp.module
    else:
        tracked["model"] = ddp
    if "two-optimizers" in use:
        optims = [
            torch.optim.AdamW(net.body.parameters(), lr=3e-3),
            torch.optim.SGD(net.head.parameters(), lr=0.05, momentum=0.9),
        ]
        tracked.update(optim=optims[0], head_optim=optims[1])
    else:
        optims = [torch.optim.AdamW(net.parameters(), lr=3e-3)]
        tracked["optim"] = optims[0]
    sched = None
    if "lambdalr" in use:
        sched = torch.optim.lr_scheduler.LambdaLR(optims[0], lambda s: 1.0 / (1.0 + 0.1 * s))
        tracked["sched"] = sched
    scaler = None
    if "scaler" in use:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=4)
        tracked["scaler"] = scaler
    stats = None
    if "user-stateful" in use:
        stats = RunningStats()
        tracked["stats"] = stats
    data = dataset()
    loader = sampler = None
    if "stateful-loader" in use or "worker-random" in use or "cycle-loader" in use:
        from torchdata.stateful_dataloader import StatefulDataLoader

        random_draws = "worker-random" in use
        loader = StatefulDataLoader(
            Augmented(data) if random_draws else data,
            batch_size=BATCH,
            sampler=DistributedSampler(data, ctx.world_size, ctx.rank, shuffle=True, seed=3),
            num_workers=2,
            collate_fn=masked_collate if random_draws else None,
            worker_init_fn=_record_worker if args.record_workers else None,
        )
        tracked["data"] = loader
    if "resumable-sampler" in use:
        sampler = peerckpt.ResumableSampler(ROWS, ctx.rank, ctx.world_size, seed=11)
        tracked["sampler"] = sampler

    if "app-state" in use:
        tracked = {
            "app": AppState(tracked.pop("model"), [tracked.pop("optim"), *optims[1:]]),
            **{k: v for k, v in tracked.items() if k != "head_optim"},
        }
    ctx.track(**{k: v for k, v in tracked.items() if k not in args.leave_out})
    if ddp is None:
        ddp = DDP(net, **wrap)  # wrapped after track: the DDP object itself is never tracked
    if args.record_workers and ctx.restored_step is not None:
        record_orphans(args.out, ctx)

    batches = None
    if loader is not None:  # "cycle-loader": lucidrains' ``self.dl = cycle(dl)``, made lazily
        batches = _cycle(loader) if "cycle-loader" in use else iter(loader)

    def next_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(batches) if batches is not None else _indexed(data, step, micro, ctx)
        if sampler is not None:  # a second stream: noise rows picked by the sampler
            x = x + 0.1 * data.tensors[0][sampler.take(BATCH)][: len(x)]
        return x, y

    micro_batches = 2 if "accumulation" in use else 1
    noise = torch.Generator().manual_seed(17 + ctx.rank) if "own-generator" in use else None
    state = types.SimpleNamespace(seen=0, rank=ctx.rank)  # "attribute-counter"
    steps = range(args.steps) if args.loop == "range" else ctx.steps(args.steps)
    ahead = next_batch(0, 0) if "prefetch" in use else None
    with open(os.path.join(args.out, f"rank{ctx.rank}.jsonl"), "a") as log:
        for step in steps:
            while args.hold and step == 3 and not os.path.exists(args.hold):
                time.sleep(0.05)
            net.train()
            for micro in range(micro_batches):
                x, y = ahead if ahead is not None else next_batch(step, micro)
                if noise is not None:
                    x = x + 0.05 * torch.randn(x.shape, generator=noise)
                last = micro == micro_batches - 1
                with nullcontext() if last else ddp.no_sync():
                    logits = ddp(x)
                    loss = nn.functional.cross_entropy(logits, y) / micro_batches
                    if "module-counter" in use:  # a warm-up on the module's counter
                        seen_steps += 1
                        loss = loss * min(1.0, seen_steps / 12)
                    if "attribute-counter" in use:  # the same on an object's attribute
                        state.seen += 1
                        loss = loss * min(1.0, state.seen / 16)
                    (scaler.scale(loss) if scaler else loss).backward()
                if stats is not None:
                    stats.update(logits, len(x))
            for optim in optims:
                if scaler is not None:
                    scaler.step(optim)
                else:
                    optim.step()
            if scaler is not None:
                scaler.update()
            if sched is not None:
                sched.step()
            for optim in optims:
                optim.zero_grad()
            if ahead is not None:
                ahead = next_batch(step + 1, 0)  # for the next step, as nanoGPT does
            if args.sleep:
                time.sleep(args.sleep)
            entry = {
                "step": step,
                "epoch": ctx.epoch,
                "digest": digest(tracked),
                "loss": loss.item(),
            }
            log.write(json.dumps(entry) + "\n")
            log.flush()
    return digest(tracked)


def _cycle(loader):
    while True:
        yield from loader  # lucidrains: ``for data in dl: yield data``


def _indexed(data: TensorDataset, step: int, micro: int, ctx: peerckpt.Context):
    """The plain way: each rank reads its slice of the data by step number."""
    start = ((step * 2 + micro) * ctx.world_size + ctx.rank) * BATCH % ROWS
    return data[start : start + BATCH]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--patterns", default="all")
    parser.add_argument("--leave-out", default="", help="names used but not tracked")
    parser.add_argument("--record-workers", action="store_true")
    parser.add_argument("--loop", choices=("steps", "range"), default="steps")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--hold", default="")
    args = parser.parse_args()
    args.leave_out = set(filter(None, args.leave_out.split(",")))
    args.patterns = (
        set(EXACT) - {"module-tracked", "ddp-tracked", "app-state", "prefetch", "static-graph"}
        if args.patterns == "all"
        else set(args.patterns.split(","))
    )
    unknown = args.patterns - set(PATTERNS)
    if unknown:
        parser.error(f"unknown patterns {sorted(unknown)}; choose from {PATTERNS}")
    if args.record_workers:
        os.makedirs(os.path.join(args.out, "workers"), exist_ok=True)
        os.environ["USER_LOOP_WORKERS"] = os.path.join(args.out, "workers")
    return args


if __name__ == "__main__":
    args = parse()
    final = train(args)
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(args.out, "final.json"), "w") as f:
            json.dump({"digest": final}, f)
