"""``make demo``: train a small language model twice, once undisturbed and once under chaos,
and show that peerckpt's recovery is invisible in the bits.

The chaos run kills one rank partway, then a whole node. Every rank records a digest of its
model and optimizer after every step; each digest of the chaos run (re-executed steps
included) must equal the fault-free run's for the same rank and step. Exits non-zero if not,
or if either job failed. Output, including each job's log, goes to demo-out/.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from peerckpt.runtime.launcher import JobResult, JobSpec, LocalLauncher

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "demo-out"
SCRIPT = REPO / "examples" / "train_lm.py"
STEPS = 300
# After the first failure rank 1 lives on the spare node 2, so node 1 then holds ranks 2, 3.
CHAOS = "kill rank=1 at=100; kill node=1 at=200"


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Send this process's stderr, and so every job process's, to ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def run_job(name: str, spares: int = 0, chaos: str = "") -> tuple[JobResult, Path]:
    out = OUT / name
    out.mkdir(parents=True)
    log = OUT / f"{name}.log"
    print(f"{name} run: 2 nodes × 2 ranks, {spares} spare(s), chaos {chaos or 'none'!r} …")
    spec = JobSpec(
        script=str(SCRIPT),
        args=[str(out), "--steps", str(STEPS)],
        nodes=2,
        nproc_per_node=2,
        spares=spares,
        chaos=chaos,
    )
    with stderr_to(log):
        result = LocalLauncher(spec).run()
    print(f"  {result.state} in {result.wall_s:.1f} s (log: {log.relative_to(REPO)})")
    if result.reason:
        print(f"  reason: {result.reason}")
    return result, out


def digests(out: Path) -> dict[tuple[int, int], list[str]]:
    """(rank, step) → the digest of every time some process ran that step."""
    found: dict[tuple[int, int], list[str]] = {}
    for path in sorted(out.glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            found.setdefault((rank, entry["step"]), []).append(entry["digest"])
    return found


def print_failures(result: JobResult) -> bool:
    """One paragraph per failure; True if every failure was recovered from."""
    fired = [f for f in result.chaos if f.get("fired_at")]
    ok = len(result.events) == len(fired) > 0
    for i, event in enumerate(result.events):
        cause = fired[i] if i < len(fired) else {"action": "?", "fired_at": event["detected_at"]}
        t0 = cause["fired_at"]
        print(
            f"  {cause['action']!r}: lost rank(s) {event['ranks']} on node(s) {event['nodes']}, "
            f"restored step {event.get('restore_step')}"
        )
        print(f"    detected after      {(event['detected_at'] - t0) * 1000:6.0f} ms")
        if event.get("resumed_at"):
            print(f"    all ranks stepping  {(event['resumed_at'] - t0) * 1000:6.0f} ms after kill")
        else:
            print("    never resumed")
            ok = False
        for pull in sorted(event.get("pulls", []), key=lambda p: p["rank"]):
            where = "own node" if pull["source"] == pull["node"] else f"node {pull['source']}"
            print(
                f"    rank {pull['rank']} (now on node {pull['node']}) pulled "
                f"{pull['bytes'] / 1024:.0f} KiB from {where} in {pull['seconds'] * 1000:.1f} ms"
            )
    return ok


def main() -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s peerckpt[demo] %(message)s")
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    clean, clean_out = run_job("fault-free")
    chaos, chaos_out = run_job("chaos", spares=3, chaos=CHAOS)
    if clean.exit_code or chaos.exit_code:
        print("FAILED: a job did not succeed; see its log")
        return 1

    ref_final = json.loads((clean_out / "final.json").read_text())
    got_final = json.loads((chaos_out / "final.json").read_text())
    ref, got = digests(clean_out), digests(chaos_out)
    print(f"\nmodel: byte-level transformer, {STEPS} steps, loss (rank 0's batch):")
    for name, final in (("fault-free", ref_final), ("chaos", got_final)):
        print(
            f"  {name:10s} {final['first_loss']:.4f} at step {final['first_step']} → "
            f"{final['last_loss']:.4f} at step {final['last_step']}"
        )
    print("\nfailures in the chaos run:")
    recovered = print_failures(chaos)

    complete = all(len(ref.get((r, s), [])) == 1 for r in range(4) for s in range(STEPS))
    missing = sorted(set(ref) - set(got))
    wrong = sorted(k for k, ds in got.items() for d in ds if d != ref.get(k, [None])[0])
    checked = sum(len(ds) for ds in got.values())
    rerun = checked - len(got)
    final_same = got_final["digest"] == ref_final["digest"]
    print("\nbit-exactness against the fault-free run:")
    print(f"  final model+optimizer digest: {'identical' if final_same else 'DIFFERENT'}")
    print(
        f"  per-step digests: {checked - len(wrong)}/{checked} identical "
        f"({rerun} from steps re-executed after a restore), {len(missing)} (rank, step) missing"
    )
    if wrong:
        print(f"  first mismatches (rank, step): {wrong[:5]}")
    leftovers = [p for r in (clean, chaos) for p in glob.glob(f"/dev/shm/peerckpt-{r.job}-*")]
    if leftovers:
        print(f"  shared-memory files left behind: {leftovers}")
    ok = complete and final_same and not wrong and not missing and recovered and not leftovers
    print(f"\n{'OK: recovery was bit-exact' if ok else 'FAILED: see above'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
