"""The goodput benchmark's job without peerckpt: a torchrun script that restarts from DCP.

usage: torchrun ... goodput_dcp_job.py OUT_DIR [--mib M] [--steps N] [--batch B]
                    [--ckpt DIR --ckpt-every K]

The same training as ``cost_job.py`` (``train_job.build``: an MLP under DDP, fused AdamW, the
parameters and both moments about M MiB per rank; the batch of each step seeded by the step
and the rank), written as a torchrun user writes it: every K steps every rank saves the model
and the optimizer with ``torch.distributed.checkpoint`` (``get_state_dict``) into DIR/step-S,
then rank 0 names it in DIR/latest; a (re)started worker that finds ``latest`` drops its files
from the page cache (``posix_fadvise``, as ``torchrun_job.py`` does) and loads it. Without
``--ckpt`` nothing is saved: the plain loop, the baseline every checkpointing scheme pays its
overhead against.

Each step's span goes to OUT_DIR/steps-rank<r>.jsonl (``epoch``: torchelastic's restart
count, ``step``, ``t0``, ``t1``), each save's duration to OUT_DIR/saves-rank<r>.jsonl; at the
end rank 0 writes the digest of its model and optimizer to OUT_DIR/final-e<epoch>.json.
"""

import argparse
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from cost_job import digest
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
from torchrun_job import drop_cache, init_fresh_group
from train_job import build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--ckpt-every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_fresh_group()
    rank, epoch = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = DistributedDataParallel(build(args.mib))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    start = 0
    latest = os.path.join(args.ckpt, "latest") if args.ckpt else ""
    if latest and os.path.exists(latest):
        with open(latest) as f:
            saved = int(f.read())
        path = os.path.join(args.ckpt, f"step-{saved}")
        drop_cache(path)
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        start = saved + 1
    hidden = model.module[0].in_features
    steps_log = open(os.path.join(args.out, f"steps-rank{rank}.jsonl"), "a")  # noqa: SIM115
    saves_log = open(os.path.join(args.out, f"saves-rank{rank}.jsonl"), "a")  # noqa: SIM115
    for step in range(start, args.steps):
        t0 = time.time()
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(args.batch, hidden, generator=g)
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=False)
        if args.ckpt and step % args.ckpt_every == 0:
            began = time.time()
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{args.ckpt}/step-{step}")
            dist.barrier()
            if rank == 0:
                with open(latest + ".tmp", "w") as f:
                    f.write(str(step))
                os.replace(latest + ".tmp", latest)
                old = step - 2 * args.ckpt_every
                shutil.rmtree(os.path.join(args.ckpt, f"step-{old}"), ignore_errors=True)
            saves_log.write(json.dumps({"step": step, "s": time.time() - began}) + "\n")
            saves_log.flush()
        line = {"epoch": epoch, "step": step, "t0": t0, "t1": time.time()}
        steps_log.write(json.dumps(line) + "\n")
        steps_log.flush()
    steps_log.close()
    saves_log.close()
    if rank == 0:
        with open(os.path.join(args.out, f"final-e{epoch}.json"), "w") as f:
            json.dump({"digest": digest(model.module, optim)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
