"""What would remove each missed goal: the half of a miss that a benchmark cannot measure.

A benchmark's JSON says why a target was missed in the run (``reason``: the causes it
measured). What would remove the miss is knowledge of the code, the same from run to run,
kept here beside the figures it is about, so that ``bench/summary.py`` writes both under the
table. ``remedy(name, key)`` finds it by the result's name and the target's key; a missed
target without one reads "not known yet" in the table (``tests/test_bench_summary.py``
checks that every target today's results miss has one).
"""

from __future__ import annotations

import re

_REPLACEMENT_COPY = (
    "restoring the replacement without a copy into fresh memory (its tensors made on the "
    "slot's pages, or the state received straight into the tensors it builds), a spare node's "
    "agent creating and touching its spares' slots while they wait"
)
_RECOVERY_COPY = (
    _REPLACEMENT_COPY + ", and survivors that keep their model across an epoch whose world "
    "size did not change instead of building it again and copying their state back on the "
    "same cores (docs/performance.md, “Recovery of one rank”); not built"
)

# (result name : target key, as a regular expression) → what would remove the miss
REMEDIES: list[tuple[str, str]] = [
    (
        r"stall:stall_fraction_\w+",
        "a GPU: the snapshot copy runs on a copy engine and the agents' checksums and sends "
        "overlap device compute (gpu.json: +0.3 % per step at every step on an H100); on "
        "CPU-only machines snapshots every step are not the setting to use: the overhead "
        "budget (`resilient(overhead=…)`, the budget rows) chooses the interval",
    ),
    (
        r"stall:budget_stall_\w+",
        "measuring a snapshot's cost again in the steady state (each interval's steps against "
        "the plain step) and letting the ranks agree on a larger n when the budget is overrun; "
        "not built. The 5 % is within this machine's noise: the plain steps before and after "
        "the measured stretch differ by as much",
    ),
    (
        r"replication:ratio_to_socket",
        "between hosts, sender and receiver have their own cores; here both processes, both "
        "sides' checksums and both socket copies share 2, so the ratio moves with the "
        "socket's own figure (1.05 against a 1.95 GB/s socket, 0.78 against 3.15). The "
        "sender's checksums computed by the rank during its slot copy (one pass instead of "
        "two) would take the sender's crc32c off the push; not built",
    ),
    (
        r"tls:ratio_tls_to_clear",
        "kernel TLS (Python 3.12's ssl.OP_ENABLE_KTLS) would move the record layer into the "
        "kernel; between hosts, sender and receiver each have their own cores (here they "
        "share 2 on loopback)",
    ),
    (r"recovery:(speedup_vs_dcp|peerckpt_s)_\w+", _RECOVERY_COPY),
    (
        r"recovery:transfer_ratio_(to_socket|in_training)_\w+",
        "a spare node's agent creating and touching its spares' slots while they wait "
        "(allocating the new slot costs 0.2 s of CPU per 256 MiB inside the transfer), and "
        "several connections per pull; not built. On this machine the cores, not the socket, "
        "limit it: the sender's and receiver's checksums share 2 cores with the ranks "
        "rebuilding their models",
    ),
    (
        r"recovery:failure_cost_(s|vs_torchft)_\w+",
        "the survivors' part: their ctx.track builds the model and DDP again and copies the "
        "committed step back on cores four processes share, and the further the committed "
        "step lags the live one (the interval the budget chose), the more steps are re-done. "
        "Survivors that keep their model across an epoch whose world size did not change "
        "(their copy 0.024 s instead of 0.14 s at 256 MiB), and a snapshot every step where "
        "snapshots are cheap (the GPU path); " + _REPLACEMENT_COPY,
    ),
    (
        r"reshard:.*dcp\.load.*",
        "reading straight into the destination tensors with no staging segment (local pieces "
        "with preadv from the holding slot's file, remote pieces received into the tensor): "
        "one copy and one fresh allocation less per byte, about 0.5 s of the 1.34 s; not built",
    ),
    (
        r"flush:durable flush.*",
        "a core for the writers: with the ranks idle the same flush runs at 1.17 of the disk; "
        "while training the two writers (nice 5) wait for cores the ranks keep busy. The "
        "disk's own figure also moves between 1.2 and 2.2 GB/s from run to run (a virtual "
        "disk); earlier runs of the same code measured 0.72–0.90",
    ),
    (
        r"coordinator:coordinator_commit_p99_\w+",
        "cores: here the coordinator and the 1,000 simulated nodes share 2, with other work. "
        "Built since: a stream per node and cheaper decoding (bench/scale.py: p99 0.40 s at "
        "0.44 cores on 2026-11-27); past one core, an aggregator per rack "
        "(docs/performance.md, “A cluster's size”)",
    ),
    (
        r"scale:(plan_10k_end_to_end_s|coordinator_commit_p99_\w+|rendezvous_10k_s)",
        "cores for the coordinator and the store: on this 2-core machine the simulated ranks "
        "and nodes and other people's work share them (the JSON has each part's CPU time "
        "beside its wall time, and the load); on a cluster the ranks are other machines",
    ),
    (
        r"goodput:ettr_peerckpt(_every_step)?",
        "a GPU: snapshots every step cost +0.3 % there, so a fault costs the recovery (0.1–0.3 "
        "s) and at most one step: 1 − 0.5 s / 20 s ≈ 0.975. On these 2 cores the snapshots' "
        "own cost caps it, at Young/Daly's 1 − sqrt(2·C/MTBF) for the chosen interval",
    ),
    (
        r"gpu-nccl:4 NCCL ranks on one GPU.*bit-exact.*",
        "a comparison that allows the survivors' step in flight: NCCL's all-reduce is "
        "asynchronous, so a survivor's step finishes on what the aborted kernel left and the "
        "job records it before the next step boundary discards it (gloo's raises instead). "
        "bench/gpu.py and tests/gpu/digests.py now allow exactly that record and still require "
        "every step trained again and the final state to equal the fault-free run's; not yet "
        "re-run on a GPU",
    ),
    (
        r"gpu-nccl:recovery pull .*NCCL / TCP",
        "a transport faster than NCCL's sockets between the agents: on a cluster NCCL's "
        "InfiniBand or NVLink paths (not available to two agents on one GPU, which NCCL "
        "treats as two hosts); on one GPU more socket threads (NCCL_SOCKET_NTHREADS, "
        "NCCL_NSOCKS_PERTHREAD), not yet tried",
    ),
]


def remedy(name: str, key: str) -> str | None:
    """What would remove the miss of target ``key`` of result ``name``, if known."""
    for pattern, text in REMEDIES:
        if re.fullmatch(pattern, f"{name}:{key}"):
            return text
    return None
