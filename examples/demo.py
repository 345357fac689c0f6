"""``make demo``: train a small language model twice, once undisturbed and once under chaos,
and show that peerckpt's recovery is invisible in the bits.

The chaos run kills one rank partway, then a whole node. Every rank records a digest of its
model and optimizer after every step; each digest of the chaos run (re-executed steps
included) must equal the fault-free run's for the same rank and step. Exits non-zero if not,
or if either job failed. Output, including each job's log and report and the chaos run's
timeline picture (demo-out/chaos-timeline.png), goes to demo-out/.
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

from peerckpt.launch.base import JobResult, JobSpec
from peerckpt.launch.local import LocalLauncher
from peerckpt.launch.report import failure_rows, format_failures
from peerckpt.launch.timeline import timeline

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "demo-out"
SCRIPT = REPO / "examples" / "train_lm.py"
STEPS = 300
# After the first failure rank 2 lives on the spare node 2; node 0 still holds ranks 0 and 1,
# whose replicas are on node 1, so their replacements pull them from node 1 over TCP.
CHAOS = "kill rank=2 at=100; kill node=0 at=200"


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
    print(
        f"{name} run: 2 nodes × 2 ranks, {spares} spare(s), chaos: {chaos or 'none'} …", flush=True
    )
    spec = JobSpec(
        script=str(SCRIPT),
        args=[str(out), "--steps", str(STEPS)],
        nodes=2,
        nproc_per_node=2,
        spares=spares,
        chaos=chaos,
        report=str(OUT / f"{name}-report.json"),
    )
    with stderr_to(log):
        result = LocalLauncher(spec).run()
    print(f"  {result.state.value} in {result.wall_s:.1f} s (log: {log.relative_to(REPO)})")
    if result.reason:
        print(f"  reason: {result.reason}")
    return result, out


def records(out: Path) -> dict[tuple[int, int], list[dict]]:
    """(rank, step) → the record of every time some process ran that step."""
    found: dict[tuple[int, int], list[dict]] = {}
    for path in sorted(out.glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            found.setdefault((rank, entry["step"]), []).append(entry)
    return found


def print_failures(result: JobResult) -> bool:
    """One paragraph per failure; True if every injected fault was recovered from."""
    for line in format_failures(result.events, result.chaos):
        print(f"  {line}")
    rows = failure_rows(result.events, result.chaos)
    injected = [r for r in rows if r.detected_s is not None]
    return len(injected) == len(rows) == len(CHAOS.split(";")) and all(
        r.recovered_s is not None for r in rows
    )


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
    ref, got = records(clean_out), records(chaos_out)
    step_ms = (ref[(0, STEPS - 1)][0]["time"] - ref[(0, 0)][0]["time"]) / (STEPS - 1) * 1000
    print(f"\n{STEPS} steps of {step_ms:.0f} ms (fault-free); loss on rank 0's batch:")
    for name, recs in (("fault-free", ref), ("chaos", got)):
        first, last = recs[(0, 0)][0]["loss"], recs[(0, STEPS - 1)][-1]["loss"]
        print(f"  {name:10s} {first:.4f} at step 0 → {last:.4f} at step {STEPS - 1}")
    print("\nfailures in the chaos run:")
    recovered = print_failures(chaos)
    picture = OUT / "chaos-timeline.png"
    timeline(str(OUT / "chaos-report.json"), str(picture), str(OUT / "chaos-timeline.json"))
    print(f"  timeline of the chaos run: {picture.relative_to(REPO)}")

    complete = all(len(ref.get((r, s), [])) == 1 for r in range(4) for s in range(STEPS))
    missing = sorted(set(ref) - set(got))
    expected = {k: rs[0]["digest"] for k, rs in ref.items()}
    wrong = sorted(k for k, rs in got.items() for r in rs if r["digest"] != expected.get(k))
    checked = sum(len(rs) for rs in got.values())
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
