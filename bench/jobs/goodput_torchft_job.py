"""The goodput benchmark's job under torchft 0.2.0: one replica group of one rank.

usage: goodput_torchft_job.py OUT_DIR --replica R --lighthouse URL [--mib M] [--steps N]
                              [--batch B] [--epoch E] [--replicas K] [--transport pg|http]

The same training as ``goodput_dcp_job.py`` and ``cost_job.py`` (``train_job.build``: an MLP,
fused AdamW, the parameters and both moments about M MiB per rank; the batch of each step
seeded by the step and the rank), written as torchft's DDP examples write it: a
``torchft.Manager`` (``ProcessGroupGloo``, ``min_replica_size=1``, the lighthouse at URL) whose
``state_dict``/``load_state_dict`` callbacks hold the model and the optimizer, torchft's
``DistributedDataParallel`` (the gradient all-reduce goes through the manager; its hook mended
for a peer that dies mid all-reduce: ``FaultTolerantDDP``) and
``OptimizerWrapper`` (its ``zero_grad`` starts the step's quorum; in place of its ``step`` the
loop calls what it calls, ``manager.should_commit()`` and the optimizer's step only when that
is true, to log whether the step was committed). A restarted process heals from a live replica: it joins the next quorum, the
manager sends it the model and optimizer state (``--transport pg``: ``PGTransport`` over the
quorum's gloo group, torchft's fast path and what its DDP example uses; ``http``: the default
``HTTPTransport``), and it steps on from the quorum's step.

Layout: each process is one replica group of one rank, four processes for the 4-rank job. With
pure data parallelism this is the only layout whose numerics are the 4-rank DDP job's: torchft's
DDP all-reduces only across replica groups (rank i of each group with rank i of the others),
so 2 groups of 2 would average each gradient over 2 ranks, not 4, unless a second, in-group
all-reduce were added (torchft's HSDP does that with FSDP, not with DDP). It also gives
torchft its best case here: a kill loses one replica group of four, and the other three keep
stepping.

The step of a row is torchft's: the manager's committed step count (``current_step()``),
shared by the quorum and carried to a healed replica; the batch of a step is seeded by that
step and R. Each committed step's span goes to OUT_DIR/steps-rank<R>.jsonl (``epoch``: E, the
supervisor's restart count of this replica; ``replica``; ``step``; ``t0`` from before the quorum; ``t1``;
``participants``: the replicas whose gradients the step averaged), a step the manager did not
commit (a peer died in its all-reduce) to OUT_DIR/discarded-rank<R>.jsonl. At step N the
process writes OUT_DIR/final-rank<R>-e<E>.json (the digest of its model and optimizer, the
step, the batches torchft counts as committed) and exits 0. A first start (E = 0) waits,
before its first step, until the K replicas' managers are up (OUT_DIR/ready-rank<r>).
"""

import argparse
import json
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from cost_job import digest
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport
from train_job import build

TIMEOUT = timedelta(seconds=30)


class FaultTolerantDDP(DistributedDataParallel):
    """torchft's DDP with its gradient hook mended for a peer that dies mid all-reduce.

    In torchft 0.2.0 the hook asserts on the future of a failed all-reduce (the manager's
    ``_ManagedWork.wait`` records the error and returns False without building the future
    the hook then asserts on; after that error the manager hands out ``_DummyWork``, whose
    future the hook cannot unwrap either), so every survivor of a kill raised
    ``AssertionError`` in ``backward`` and died with it (measured: each kill of the quick run
    took down one to three survivors). Here a failed all-reduce yields the bucket as it is:
    the manager has the error and will not commit the step, as torchft intends.
    """

    @staticmethod
    def _comm_hook(state: Manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        work = state.allreduce(bucket.buffer())
        work.wait()
        fut = work.get_future()
        inner = getattr(fut, "_fut", fut)  # a _DummyWork's future is a plain, done one
        if inner is None:  # the all-reduce failed: this step is not committed
            inner = torch.futures.Future()
            inner.set_result(bucket.buffer())
        return inner


def ready(out: str, replica: int, replicas: int, timeout: float = 300.0) -> None:
    """At the job's start, wait until every replica's manager is up, so that the first quorum
    has them all (with ``min_replica_size=1`` the first replica up would otherwise step alone
    and the others heal into the job one by one): the benchmark's start line, not torchft's."""
    open(os.path.join(out, f"ready-rank{replica}"), "w").close()
    deadline = time.monotonic() + timeout
    while (
        sum(os.path.exists(os.path.join(out, f"ready-rank{r}")) for r in range(replicas)) < replicas
    ):
        if time.monotonic() > deadline:
            raise SystemExit(
                f"not every one of the {replicas} replicas started within {timeout:g} s"
            )
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--lighthouse", required=True, help="http://HOST:PORT")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=4, help="the first start waits for all")
    parser.add_argument("--transport", choices=("pg", "http"), default="pg")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    replica = args.replica
    module = build(args.mib)  # seeded: every replica starts from the same parameters
    inner = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)

    def state_dict() -> dict[str, Any]:
        return {"model": module.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        module.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    # This replica group's store (torchelastic would host it for a group of several ranks).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    transport = PGTransport(pg, TIMEOUT, torch.device("cpu")) if args.transport == "pg" else None
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"goodput_{replica}",
        hostname="127.0.0.1",
        checkpoint_transport=transport,
        init_sync=False,  # build() seeds: the replicas' initial parameters are equal
    )
    if args.epoch == 0:
        ready(args.out, replica, args.replicas)
    model = FaultTolerantDDP(manager, module)
    optim = Optimizer(manager, inner)
    hidden = module[0].in_features
    steps_log = open(os.path.join(args.out, f"steps-rank{replica}.jsonl"), "a")  # noqa: SIM115
    lost_log = open(os.path.join(args.out, f"discarded-rank{replica}.jsonl"), "a")  # noqa: SIM115
    try:
        while manager.current_step() < args.steps:
            t0 = time.time()
            optim.zero_grad(set_to_none=False)  # starts the quorum (asynchronously)
            step = manager.current_step()  # a healing replica's gradient is zeroed: any seed
            g = torch.Generator().manual_seed(step * 1000 + replica)
            x = torch.randn(args.batch, hidden, generator=g)
            model(x).square().mean().backward()
            # What OptimizerWrapper.step does, keeping the manager's answer for the log.
            committed = manager.should_commit()
            if committed:
                inner.step()
            line = {"epoch": args.epoch, "replica": replica, "t0": t0, "t1": time.time()}
            if committed:  # the commit advanced the manager's step (after a heal: to the quorum's)
                line.update(
                    step=manager.current_step() - 1, participants=manager.num_participants()
                )
                steps_log.write(json.dumps(line) + "\n")
                steps_log.flush()
            else:
                lost_log.write(json.dumps(dict(line, step=step)) + "\n")
                lost_log.flush()
        final = {
            "digest": digest(module, inner),
            "step": manager.current_step(),
            "batches_committed": manager.batches_committed(),
        }
        path = os.path.join(args.out, f"final-rank{replica}-e{args.epoch}.json")
        with open(path, "w") as f:
            json.dump(final, f)
    finally:
        steps_log.close()
        lost_log.close()
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
