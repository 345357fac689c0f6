"""One rank of the alternative to peerckpt: a restarted process that loads the state of
``state_job.py`` with torch.distributed.checkpoint from local disk (or saves it there first).

usage: dcp_job.py CKPT_DIR OUT_JSONL --phase save|restart --rank R --world W --port P
                  --mib-per-rank M [--tensors T] [--spawned-at T]

``restart`` is what a job restarted after a failure does: import torch, join a fresh gloo
group (``tcp://127.0.0.1:P``), build the model's DTensors (uninitialised), ``dcp.load``
them, and take one step (a barrier: every rank stepping). Wall-clock times of each phase, the
``--spawned-at`` time the launcher started the process, and whether the loaded state is exact
(checked after the step) go to OUT_JSONL as one line. ``save`` writes the state with
``dcp.save`` instead (once, before the restarts).
"""

import time

imported_from = time.time()

import argparse  # noqa: E402
import json  # noqa: E402

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from state_layout import exact, local_shards  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--phase", choices=("save", "restart"), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mib-per-rank", type=int, required=True)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--spawned-at", type=float, default=0.0)
    args = parser.parse_args()
    times = {"spawned_at": args.spawned_at or imported_from, "imported_at": time.time()}
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
    )
    times["group_at"] = time.time()
    try:
        mesh = init_device_mesh("cpu", (args.world,))
        shards = local_shards(args, args.rank, fill=args.phase == "save")
        state = {
            f"model.{k}": DTensor.from_local(v, mesh, [Shard(0)], run_check=False)
            for k, v in shards.items()
        }
        times["built_at"] = time.time()
        if args.phase == "save":
            dcp.save(state, checkpoint_id=args.ckpt)
            dist.barrier()
            times["saved_at"] = time.time()
            ok = True
        else:
            dcp.load(state, checkpoint_id=args.ckpt)
            times["loaded_at"] = time.time()
            dist.barrier()  # one step of state_job.py: no work; every rank is stepping
            times["stepping_at"] = time.time()
            ok = exact(args, args.rank, {k[6:]: v.to_local() for k, v in state.items()})
    finally:
        dist.destroy_process_group()
    with open(args.out, "a") as f:
        f.write(json.dumps({"rank": args.rank, "exact": ok, **times}) + "\n")


if __name__ == "__main__":
    main()
