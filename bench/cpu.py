"""The CPU replication costs per replicated GB, against the floor measured in the same run.

    python bench/cpu.py [--mib 1024] [--runs 5] [--quick]

A snapshot replicated to one buddy costs the machine CPU in three places: the rank copies its
tensors into its slot (``write_slot``, the snapshot engine's copy), the sending agent
checksums the slot and pushes it (``ReplicationJob`` + ``BuddySender``), the receiving agent
receives it into a replica slot and checksums each chunk as it lands (``DataServer``). The
floor is what moving those bytes needs at least, measured here on the same buffers:

* one ``memcpy`` of the slot's bytes into a touched buffer (torch's ``copy_``, one thread);
* a plain loopback socket: the sender's ``sendall`` and the receiver's ``recv_into`` (both
  processes' CPU);
* one crc32c of the slot (a check of the bytes is part of any replication that can say the
  replica is whole).

Two processes, as in ``bench/replication.py`` (whose sending and receiving sides this reuses):
this one sends, a child receives and reports its own CPU time (``getrusage``) before and after
each transfer. CPU time, not wall time: the figure says how much of the cores replication
takes from training, which is what matters on a machine whose cores training keeps busy; it
moves much less with other people's load than a throughput does.

``ratio``: (rank's copy + sending agent + receiving agent) / (memcpy + socket send + socket
receive + crc32c), per GB, in each run; the median of the runs' ratios, goal ≤ 1.25. ``agents_ratio``: the agents alone against the floor
without the copy. Results: ``bench/results/cpu.json``.
"""

from __future__ import annotations

import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import background_load, bench_parser, job_name, leftover_segments, target, write_result

from peerckpt.replication.replicator import ReplicationJob
from peerckpt.runtime.capture import Captured, CapturedTensor, layout, write_slot
from replication import CHUNKS, Sender, _manifest, cpu_s, receiver

GOAL = 1.25


class _Pusher(Sender):
    """The sending agent, without ``replicate_s``'s extra timing of a checksum."""

    def push(self) -> None:
        self.step += 1
        manifest = _manifest(self.step, self.nbytes)
        self._done.clear()
        with self.slot.lock:
            job = ReplicationJob.start(0, self.slot, manifest, [1])
        self.sender.put(job)
        if not self._done.wait(300):
            raise SystemExit("replication did not finish in 300 s")
        if self._error is not None:
            raise SystemExit(f"replication failed: {self._error!r}")


# -- the floor's local parts, and the rank's copy -----------------------------------------
def _thread_cpu(fn: Any) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


class Local:
    """The rank's snapshot copy and the floor's memcpy and crc32c, on touched buffers."""

    def __init__(self, nbytes: int) -> None:
        size = nbytes // CHUNKS
        self.tensors = [torch.full((size // 4,), float(i)) for i in range(CHUNKS)]
        captured = [
            CapturedTensor(f"w{i}", t, tuple(t.shape), (0,), "global")
            for i, t in enumerate(self.tensors)
        ]
        self.captured = Captured(captured, b"\0" * 4096)
        self.chunks, used = layout(captured, len(self.captured.blob))
        self.slot = torch.zeros(used, dtype=torch.uint8)  # touched, as a rank's slot is
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)

    def rank_copy_s(self) -> float:
        return _thread_cpu(lambda: write_slot(self.slot, self.chunks, self.captured))

    def memcpy_s(self) -> float:
        return _thread_cpu(lambda: self.dst.copy_(self.src))

    def crc32c_s(self) -> float:
        view = memoryview(self.src.numpy())
        return _thread_cpu(lambda: crc32c.crc32c(view))


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--mib", type=int, default=1024, help="snapshot size")
    args = parser.parse_args()
    runs = 2 if args.quick else args.runs
    mib = 256 if args.quick else args.mib
    nbytes = mib << 20
    gb = nbytes / 1e9
    torch.set_num_threads(1)
    load = background_load()
    print(f"background load before starting: {load}", flush=True)
    job, secret = job_name("benchcpu"), secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=receiver, args=(job, secret, nbytes, theirs), name="receiver")
    child.start()
    sender = None

    def child_cpu() -> float:
        ours.send("cpu")
        return float(ours.recv())

    def both(fn: Any) -> tuple[float, float]:
        """(this process's, the child's) CPU seconds spent while ``fn`` runs."""
        mine, theirs_ = cpu_s(), child_cpu()
        fn()
        return cpu_s() - mine, child_cpu() - theirs_

    rows: list[dict[str, float]] = []
    try:
        if not ours.poll(120):
            raise SystemExit("the receiving agent did not start")
        data_addr, sink_port = ours.recv()
        sender = _Pusher(job, secret, nbytes, data_addr, sink_port)
        local = Local(nbytes)
        for _ in range(2):  # the receiver allocates its two replica slots; first touches
            sender.push()
        sender.socket_s()
        local.rank_copy_s()
        for i in range(runs):
            send, recv = both(sender.socket_s)
            agent_send, agent_recv = both(sender.push)
            row = {
                "memcpy": local.memcpy_s(),
                "crc32c": local.crc32c_s(),
                "socket_send": send,
                "socket_recv": recv,
                "rank_copy": local.rank_copy_s(),
                "agent_send": agent_send,
                "agent_recv": agent_recv,
            }
            rows.append({k: v / gb for k, v in row.items()})  # CPU seconds per GB
            print(f"run {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in rows[-1].items()), flush=True)
    finally:
        if sender is not None:
            sender.close()
        ours.send("stop")
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
        left = leftover_segments(job)
    per_gb = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    floor = per_gb["memcpy"] + per_gb["socket_send"] + per_gb["socket_recv"] + per_gb["crc32c"]
    ours_ = per_gb["rank_copy"] + per_gb["agent_send"] + per_gb["agent_recv"]
    agents_floor = floor - per_gb["memcpy"]
    agents = per_gb["agent_send"] + per_gb["agent_recv"]
    ratios = [
        (r["rank_copy"] + r["agent_send"] + r["agent_recv"])
        / (r["memcpy"] + r["socket_send"] + r["socket_recv"] + r["crc32c"])
        for r in rows
    ]
    ratio = statistics.median(ratios)  # each run's against the floor of the same run
    result: dict[str, Any] = {
        "bytes": nbytes,
        "chunks": CHUNKS,
        "runs": runs,
        "quick": args.quick,
        "cpu_s_per_gb": per_gb,
        "floor_cpu_s_per_gb": floor,
        "peerckpt_cpu_s_per_gb": ours_,
        "ratio": ratio,
        "ratio_of_medians": ours_ / floor,
        "ratio_runs": ratios,
        "agents_ratio": agents / agents_floor,
        "runs_cpu_s_per_gb": rows,
        "leftover_segments": left,
    }
    result["targets"] = {"cpu_ratio_to_floor": target(ratio, GOAL, "at most")}
    excess = {
        "the sending agent over a socket send + one crc32c": per_gb["agent_send"]
        - per_gb["socket_send"]
        - per_gb["crc32c"],
        "the receiving agent over a socket receive": per_gb["agent_recv"] - per_gb["socket_recv"],
        "the rank's copy over one memcpy": per_gb["rank_copy"] - per_gb["memcpy"],
    }
    result["excess_cpu_s_per_gb"] = excess
    if ratio > GOAL:
        worst = max(excess, key=lambda k: excess[k])
        result["targets"]["cpu_ratio_to_floor"]["reason"] = (
            f"{ours_:.3f} CPU s/GB against a floor of {floor:.3f}; the largest excess is "
            f"{worst} ({excess[worst]:.3f} s/GB). The receiving agent checksums every chunk "
            f"again as it lands ({per_gb['crc32c']:.3f} s/GB), which the floor counts once"
        )
    path = write_result("cpu", result)
    print(
        f"replication CPU {ours_:.3f} s/GB against the floor {floor:.3f} s/GB: {ratio:.2f} "
        f"(goal ≤ {GOAL}); the agents alone {agents / agents_floor:.2f} of theirs"
    )
    if left:
        print(f"removed segments left behind: {left}")
    print(f"written {path}")


if __name__ == "__main__":
    main()
