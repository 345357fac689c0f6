"""A CPU training loop for the stall and memory benchmarks: an MLP whose parameters and AdamW
state together hold about ``--mib`` MiB per rank, one snapshot per step under peerckpt.

usage: train_job.py OUT_DIR --mib M --batch B [--steps N] [--plain-steps P]
                    [--plain-after A] [--plain] [--ddp] [--no-dedup]

Each rank trains its own model (no collectives: the figure is what snapshotting costs the
loop, not what a gradient all-reduce costs), one thread, fused AdamW; with ``--ddp`` the
ranks train one model under DistributedDataParallel (the redundancy-aware replication case of
``bench/memory.py``; ``--no-dedup``: ``resilient(dedup=False)``). Under ``peerckpt run``
the function first runs ``--plain-steps`` steps before ``ctx.track`` (nothing tracked, no
snapshot: the baseline, in the same processes at the same moment), then ``--steps`` steps of
``ctx.steps`` (a snapshot after every one), then ``--plain-after`` steps outside ``ctx.steps``
again (no snapshot: the baseline's second half, so that a change of the machine's speed
during the run shows rather than counting as overhead). With ``--plain`` the whole loop runs without
peerckpt, as rank ``$RANK`` (default 0). Step times go to
OUT_DIR/steps-<peerckpt|plain>-rank<r>.json: ``plain_times``, ``times`` (with snapshots), ``plain_after_times``, and
before and after every step of each (``plain_probes``, ``probes``): the time the loop has been
blocked by the snapshot engine, and the CPU seconds used by the rank process and by the job's
agents.
"""

import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn

LAYERS = 4


def build(mib: int) -> nn.Sequential:
    params = (mib << 20) // 4 // 3  # parameters, exp_avg, exp_avg_sq
    hidden = int(math.sqrt(params / LAYERS))
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(hidden, hidden, bias=False), nn.ReLU()]
    return nn.Sequential(*layers)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> float:
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=False)
    return float(loss.item())


def state_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) * 3


def loop(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, steps, probe=None):
    """Step times (each from the end of the previous step: what a snapshot between two steps
    costs lands in the next one) and, with ``probe``, what it returned after each step."""
    times, probes = [], [probe()] if probe else []
    last = time.perf_counter()
    for _ in steps:
        train_step(model, optim, x)
        now = time.perf_counter()
        times.append(now - last)
        if probe:
            probes.append(probe())
        last = time.perf_counter()  # the probe's own time is not the step's
    return times, probes


def agents_cpu_s() -> float:
    """CPU seconds the job's agents have used so far (the launcher's agent children)."""
    import psutil

    total = 0.0
    for proc in psutil.Process(os.getppid()).children():
        try:
            if "peerckpt.replication.agent" in " ".join(proc.cmdline()):
                cpu = proc.cpu_times()
                total += cpu.user + cpu.system
        except psutil.Error:
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mib", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--plain-steps", type=int, default=0)
    parser.add_argument("--plain-after", type=int, default=0)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument(
        "--overhead", type=float, default=None, help="resilient(overhead=F); default: every step"
    )
    parser.add_argument(
        "--ddp", action="store_true", help="one model for all ranks: DDP over the world"
    )
    parser.add_argument("--no-dedup", action="store_true", help="resilient(dedup=False)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build(args.mib)
    optim = optimizer(model)
    hidden = model[0].in_features
    assert isinstance(hidden, int)
    x = torch.randn(args.batch, hidden, generator=torch.Generator().manual_seed(1))
    if args.plain:
        result = {"times": loop(model, optim, x, range(args.steps))[0]}
        rank, name = int(os.environ.get("RANK", "0")), "plain"
    else:
        import peerckpt

        @peerckpt.resilient(
            every=None if args.overhead is not None else 1,
            overhead=args.overhead or 0.05,
            dedup=not args.no_dedup,
        )
        def train(ctx: peerckpt.Context) -> dict:
            engine = ctx._tracking.engine
            tracked, optim_ = model, optim
            if args.ddp:  # gradients all-reduced: every rank keeps the same model and state
                from torch.nn.parallel import DistributedDataParallel

                tracked = DistributedDataParallel(model)
                optim_ = optimizer(tracked)

            def probe() -> list[float]:
                # time blocked by the snapshot engine so far; CPU seconds of this process
                # (training, the snapshot copy thread) and of the agents (checksums, sends)
                return [engine.stall_s, time.process_time(), agents_cpu_s()]

            plain, plain_probes = loop(tracked, optim_, x, range(args.plain_steps), probe)
            ctx.track(model=tracked, optim=optim_)
            times, probes = loop(tracked, optim_, x, ctx.steps(args.steps), probe)
            after, _ = loop(tracked, optim_, x, range(args.plain_after))
            return {
                "plain_times": plain,
                "times": times,
                "plain_after_times": after,
                "plain_probes": plain_probes,
                "probes": probes,
            }

        result = train()
        rank, name = int(os.environ["RANK"]), "peerckpt"
    result.update(state_bytes=state_bytes(model), batch=args.batch, pid=os.getpid())
    with open(os.path.join(args.out, f"steps-{name}-rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
