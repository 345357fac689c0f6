"""The table at the top of ``docs/performance.md``, from ``bench/results/*.json``.

    python bench/summary.py [--print]

Every figure with a target, from every benchmark's result: its value, the target, whether it
is met, and what it was measured on (date, machine, whether other work kept the machine busy
meanwhile); then, for every missed target, the reason the benchmark measured and what would
remove it (``bench/remedies.py``). The table replaces what lies between the two
``bench-summary`` markers in the page (they are added under its first paragraph when
missing); everything else in the page is left as it is.
Results of ``--quick`` runs are never used.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS
from remedies import remedy

PAGE = REPO / "docs" / "performance.md"
START, END = "<!-- bench-summary:start -->", "<!-- bench-summary:end -->"
ORDER = [
    "ceilings",
    "stall",
    "cadence",
    "replication",
    "cpu",
    "tls",
    "recovery",
    "survivors",
    "memory",
    "dedup",
    "reshard",
    "flush",
    "planner",
    "coordinator",
    "scale",
    "torchrun",
    "hosts",
    "ray",
    "goodput",
]

# Their own make targets (too long for make bench's 25 minutes): timed apart.
OUTSIDE_MAKE_BENCH = {"goodput", "gpu", "survivors"}

# figure key (regular expression) → how the row reads, and how its value is written
LABELS: list[tuple[str, str, str]] = [
    (r"stall_fraction_(\w+)", "training stall, {0} per rank, snapshot every step", "percent"),
    (r"ratio_to_socket", "replication between agents, checksums on / loopback socket", "ratio"),
    (
        r"cpu_ratio_to_floor",
        "replication CPU per GB (rank's copy + both agents) / memcpy + socket + crc32c",
        "ratio",
    ),
    (r"ratio_tls_to_clear", "replication over TLS / the same push in the clear", "ratio"),
    (r"speedup_vs_dcp_(\w+)", "recovery of one rank, {0}: DCP restart time / peerckpt", "times"),
    (r"peerckpt_s_(\w+)", "recovery of one rank, {0}: kill → every rank stepping", "seconds"),
    (
        r"survivors_stepping_s",
        "a node killed, 2 × 2 DDP beside another job: kill → every rank stepping, worst of 10 "
        "(bench/survivors.py)",
        "seconds",
    ),
    (r"overhead_ratio", "host memory / 2·(1+k)·S per rank", "ratio"),
    (
        r"memory_ratio",
        "DDP job, 64 MiB per rank: buddies' replica memory, dedup / whole copies",
        "ratio",
    ),
    (
        r"agents_cpu_ratio",
        "DDP job, 64 MiB per rank: agents' CPU per snapshot step, dedup / whole copies",
        "ratio",
    ),
    (r"hosts_vs_local", "a rank killed, 3 hosts: kill → stepping / the local launcher's", "ratio"),
    (r"moved_s", "the coordinator's host killed: kill → every rank stepping", "seconds"),
    (
        r"coordinator_commit_p99_(\d+)x(\d+)",
        "one coordinator, {0} nodes × {1} ranks, a step a second: last report → commit seen, p99",
        "seconds",
    ),
    (
        r"plan_10k_end_to_end_s",
        "recovery plan, 10,000 ranks × 1,000 tensors, end to end: the ranks' Wants messages "
        "→ every node's reads (bench/scale.py)",
        "seconds",
    ),
    (
        r"coordinator_commit_p99_(\d+)x(\d+)_s",
        "one coordinator, {0} nodes × {1} ranks, a step a second, reports on a stream per "
        "node: last report → commit seen, p99 (bench/scale.py)",
        "seconds",
    ),
    (
        r"rendezvous_10k_s",
        "10,000 ranks forming an epoch's NCCL and CPU gloo groups against the coordinator's "
        "store (libuv): the first connect → the last rank's last answer (bench/scale.py)",
        "seconds",
    ),
    (
        r"coordinator_cpu_(\d+)x(\d+)",
        "one coordinator, {0} nodes × {1} ranks, a step a second: its CPU (cores)",
        "ratio",
    ),
    (
        r"failure_cost_s_(\w+)",
        "time a failure costs, {0} × 4 ranks: kill → first step after it, less a step",
        "seconds",
    ),
    (r"failure_cost_vs_torchft_(\w+)", "time a failure costs, {0}: torchft / peerckpt", "times"),
    (r"transfer_ratio_to_socket_(\w+)", "recovery transfer, {0}: / loopback socket", "ratio"),
    (r"transfer_ratio_in_training_(\w+)", "recovery transfer, {0}, the DDP job: / socket", "ratio"),
    (
        r"ettr_peerckpt",
        "ETTR under a fault every 20 s, 64 MiB × 4 ranks, interval chosen: fault-free / faulty "
        "time (make bench-goodput)",
        "ratio",
    ),
    (
        r"ettr_peerckpt_every_step",
        "ETTR under a fault every 20 s, 64 MiB × 4 ranks, a snapshot every step: fault-free / "
        "faulty time (make bench-goodput)",
        "ratio",
    ),
    (r"budget_stall_(\w+)", "training stall, {0} per rank, overhead=0.05 (n chosen)", "percent"),
    (
        r"interval_spread",
        "snapshot interval the budget chose, one job 10 times beside another: largest / smallest",
        "ratio",
    ),
]


def _fmt_target(text: str, kind: str) -> str:
    """A percent figure's target as a percentage (``< 0.01`` → ``< 1%``)."""
    sign, _, number = text.partition(" ")
    if kind != "percent":
        return text
    try:
        return f"{sign} {float(number):.0%}"
    except ValueError:
        return text


def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "not measured"
    if kind == "percent":
        return f"{value:+.1%}"
    if kind == "times":
        return f"{value:.1f}×"
    if kind == "seconds":
        return f"{value:.2f} s"
    if 0 < abs(value) < 0.01:
        return f"{value:.1e}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def _label(key: str) -> tuple[str, str]:
    for pattern, text, kind in LABELS:
        m = re.fullmatch(pattern, key)
        if m:
            return text.format(*(g.replace("MiB", " MiB") for g in m.groups())), kind
    return key.replace("_", " "), "ratio"


def _machine(result: dict[str, Any]) -> str:
    m = result.get("machine", {})
    load = result.get("background_load", {})
    text = f"{result.get('measured_at', '?')[:10]}, {m.get('cores', '?')} cores"
    if result.get("device"):
        text = f"{result.get('measured_at', '?')[:10]}, {result['device']}"
    if load:
        others = load.get("others_cores_avg")
        busy = f" ({others:.1f} cores of other work)" if others is not None else ""
        text += (", under load" if load.get("under_load") else ", quiet") + busy
    return text


def _derived_targets(name: str, r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Targets of the results written before benchmarks carried their own (``targets``)."""
    if name == "reshard" and r.get("speedup_vs_dcp_cold") is not None:
        v = r["speedup_vs_dcp_cold"]
        return {
            "resharding 4 → 2 from peer memory: dcp.load (cold disk) time / peerckpt": {
                "value": v,
                "target": "≥ 1",
                "met": v >= 1,
                "kind": "ratio",
                "reason": "see “Resharding 4 → 2 ranks” below",
            }
        }
    if name == "flush" and r.get("flush_vs_disk") is not None:
        v = r["flush_vs_disk"]
        return {
            "durable flush while training / disk write bandwidth": {
                "value": v,
                "target": "≥ 0.8",
                "met": v >= 0.8,
                "kind": "ratio",
                "reason": "see “Durable flushes” below",
            }
        }
    if name == "planner" and r.get("plan_s") is not None:
        v, goal = r["plan_s"], r.get("target_s", 2)
        label = f"recovery plan, {r['ranks']:,} ranks × {r['tensors_per_rank']:,} tensors"
        rows = {
            label: {
                "value": v,
                "target": f"< {goal:g} s",
                "met": v < goal,
                "kind": "seconds",
                "reason": "see “Planning at scale” below",
            }
        }
        # End to end (the ranks' messages → the reads) is scale.json's plan_10k_end_to_end_s:
        # the coordinator's inputs arrive as columns, no longer per chunk.
        return rows
    if name == "torchrun":
        return {
            f"under torchrun, a worker killed, {size.replace('MiB', ' MiB')} per rank: "
            "DCP restart / peerckpt's": {
                "value": row["speedup"],
                "target": "≥ 1",
                "met": row["speedup"] >= 1,
                "kind": "times",
                "reason": "torchrun restarts every worker either way; see “Under torchrun” below",
            }
            for size, row in r.get("sizes", {}).items()
            if row.get("speedup") is not None
        }
    if name == "ray" and r.get("ray_remove_node_s") is not None:
        v = r["ray_remove_node_s"]
        return {
            "a Ray node removed (spare node): kill → every rank stepping": {
                "value": v,
                "target": "≤ 2 s",
                "met": v <= 2,
                "kind": "seconds",
                "reason": "see docs/ray.md, “A lost Ray node”",
            }
        }
    if name == "gpu-nccl":
        return _nccl_targets(r)
    if name == "gpu":
        rows = {}
        for key, row in r.items():
            if isinstance(row, dict) and "stall_fraction" in row:
                rows[f"CUDA training stall, {key.replace('MiB', ' MiB')} per rank"] = {
                    "value": row["stall_fraction"],
                    "target": "< 0.01",
                    "met": row["stall_fraction"] < 0.01,
                    "kind": "percent",
                }
        return rows
    return {}


def _nccl_targets(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issues 28 and 29's figures (``bench/gpu.py --nccl``): 4 NCCL ranks on one GPU."""
    rows: dict[str, dict[str, Any]] = {}
    job, pull = r.get("job") or {}, r.get("pull") or {}
    prefix = "4 NCCL ranks on one GPU, a rank or a node killed"
    if job.get("release_s") is not None:
        rows[f"{prefix}: kill → the last survivor's groups aborted"] = {
            "value": job["release_s"],
            "target": "≤ 1 s",
            "met": job["release_s"] <= 1,
            "kind": "seconds",
        }
    if job.get("recovery_s") is not None:
        rows[f"{prefix}: kill → every rank stepping"] = {
            "value": job["recovery_s"],
            "target": "≤ 2 s",
            "met": job["recovery_s"] <= 2,
            "kind": "seconds",
        }
    kills = [job[k] for k in ("kill_rank_bit_exact", "kill_node_bit_exact") if k in job]
    if kills:
        failed = [k for k in ("kill_rank", "kill_node") if job.get(f"{k}_bit_exact") is False]
        rows[f"{prefix}: runs bit-exact against the fault-free run, fraction"] = {
            "value": sum(kills) / len(kills),
            "target": "= 1",
            "met": all(kills),
            "kind": "ratio",
            "reason": job.get("reason")
            or f"{', '.join(failed)}: a record differed from the fault-free run's",
        }
    if pull.get("ratio") is not None:
        rows["recovery pull of 1 GiB between two agents on one GPU: NCCL / TCP"] = {
            "value": pull["ratio"],
            "target": "≥ 1",
            "met": pull["ratio"] >= 1,
            "kind": "ratio",
            "reason": pull.get("reason")
            or "the agents' NCCL link runs on NCCL's socket transport (each agent an NCCL host "
            "of its own on one GPU)",
        }
    return rows


def _ceiling_rows(r: dict[str, Any]) -> list[str]:
    names = {
        "memcpy_gbps": "ceiling: memcpy, 1 GiB, one thread",
        "crc32c_gbps": "ceiling: crc32c, one core",
        "socket_gbps": "ceiling: loopback TCP, one connection",
        "disk_write_gbps": "ceiling: local disk, write + fsync into new files",
    }
    return [
        f"| {label} | {r[key]:.2f} GB/s | — | — | {_machine(r)} |"
        for key, label in names.items()
        if r.get(key) is not None
    ]


def build() -> str:
    results = {}
    for path in sorted(RESULTS.glob("*.json")):
        if path.stem.endswith("-quick"):
            continue
        results[path.stem] = json.loads(path.read_text())
    names = [n for n in ORDER if n in results] + [n for n in results if n not in ORDER]
    lines = [
        START,
        "| figure | value | target | met? | measured on |",
        "| --- | --- | --- | --- | --- |",
    ]
    reasons = []
    total_s = extra_s = 0.0
    for name in names:
        r = results[name]
        if name.split("-")[0] in OUTSIDE_MAKE_BENCH:  # goodput-torchft.json: a --systems subset
            extra_s += r.get("bench_seconds") or 0
        else:
            total_s += r.get("bench_seconds") or 0
        if name == "ceilings":
            lines += _ceiling_rows(r)
            continue
        targets = r.get("targets") or _derived_targets(name, r)
        for key, t in targets.items():
            label, kind = _label(key) if "targets" in r else (key, t.get("kind", "ratio"))
            met = {True: "✔", False: "✘", None: "—"}[t.get("met")]
            lines.append(
                f"| {label} (`{name}.json`) | {_fmt(t.get('value'), kind)} "
                f"| {_fmt_target(t['target'], kind)} "
                f"| {met} | {_machine(r)} |"
            )
            if t.get("met") is False:
                why = (t.get("reason") or "not recorded").rstrip(".")
                fix = remedy(name, key) or "not known yet"
                reasons.append(f"- **{label}**: {why}. *What would remove it*: {fix}.")
    lines.append("")
    lines.append(
        "Every value is a median of the runs its JSON lists, against a figure measured in the "
        'same run; "under load" means other work used more than 15% of the cores in the '
        "second before the benchmark started or more than a quarter of a core on average "
        "while it ran (the JSON's `background_load`)."
    )
    if total_s:
        lines.append(
            f"The benchmarks of `make bench` took {total_s / 60:.1f} minutes together"
            + (f"; `make bench-goodput` {extra_s / 60:.1f} more." if extra_s else ".")
        )
    if reasons:
        lines += [
            "",
            "Why the missed targets are missed (measured by the benchmark, in its JSON), and "
            "what would remove each (`bench/remedies.py`):",
        ]
        lines += ["", *reasons]
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="print the table, change nothing")
    args = parser.parse_args()
    table = build()
    if args.print:
        print(table)
        return
    page = PAGE.read_text()
    if START in page and END in page:
        before, rest = page.split(START, 1)
        after = rest.split(END, 1)[1]
        page = before + table + after
    else:
        head, sep, tail = page.partition("\n\n")  # after the title
        first, _, rest = tail.partition("\n\n")  # after the first paragraph
        page = f"{head}{sep}{first}\n\n{table}\n\n{rest}"
    PAGE.write_text(page)
    print(f"wrote the summary table of {PAGE}")


if __name__ == "__main__":
    main()
