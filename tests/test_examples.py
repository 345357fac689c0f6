"""The examples: the SLURM and Kubernetes ones start `peerckpt run` with flags that exist;
examples/train.py, the script a user starts from, and the README's snippet run as written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, job_name

EXAMPLES = ["slurm.sbatch", "k8s-indexed-job.yaml"]


def _run_flags() -> set[str]:
    help_text = subprocess.run(
        [sys.executable, "-m", "peerckpt.launch", "run", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return set(re.findall(r"(--[a-z][a-z-]+)", help_text))


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_flag_of_peerckpt_run_in_the_example_exists(name: str) -> None:
    text = (Path(REPO) / "examples" / name).read_text()
    command = text[text.index("peerckpt run \\") :]
    command = command[: command.index("train.py") if "train.py" in command else None]
    used = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", command))
    assert {"--nnodes", "--node-rank", "--rdzv-endpoint", "--nproc-per-node"} <= used
    assert used - _run_flags() == set(), f"{name} uses flags `peerckpt run` does not have"


# -- the script a user starts from, and the README's snippet, run as written -------------------

# The ranks' prints and the job's log lines share one pipe, and print writes its text and
# its newline separately: another process's log line can follow a loss line before its
# newline, so the line's end is the lr's own format, not the end of the line.
LOSS_LINE = re.compile(r"^step (\d+): loss (\d+\.\d{4}), lr (\d\.\d\de[+-]\d\d)", re.MULTILINE)
# A small dataset (4 batches a data epoch per rank on 2 ranks), so that restores land both
# inside a data epoch and at its end; a snapshot after every step, so they do.
EXAMPLE_ARGS = ["--steps", "30", "--rows", "256", "--batch", "32", "--log-every", "1"]


def _peerckpt_run(
    out: Path, script: Path, flags: list[str], script_args: list[str]
) -> tuple[int, str, dict]:
    """``peerckpt run FLAGS SCRIPT ARGS`` in ``out`` (its report there); always ended."""
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report.json"
    argv = [
        sys.executable,
        "-m",
        "peerckpt.launch",
        "run",
        "--job",
        job_name(),
        "--report",
        str(report),
    ]
    proc = subprocess.Popen(
        [*argv, *flags, str(script), *script_args],
        cwd=out,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # the launcher stops everything on Ctrl-C
        log, _ = proc.communicate(timeout=60)
        pytest.fail(f"the job did not end in 300 s; log tail:\n{log[-4000:]}")
    return proc.returncode, log, json.loads(report.read_text()) if report.exists() else {}


def _losses(log: str) -> dict[int, set[str]]:
    """Step → every loss rank 0 printed for it (a step trained again prints again)."""
    found: dict[int, set[str]] = {}
    for step, loss, lr in LOSS_LINE.findall(log):
        found.setdefault(int(step), set()).add(f"{loss} {lr}")
    return found


def test_the_example_recovers_a_killed_rank(tmp_path: Path) -> None:
    """examples/train.py (DDP, AdamW, a scheduler, StatefulDataLoader over DistributedSampler)
    under `peerckpt run` loses rank 1 at step 13; a spare takes its place and the job ends."""
    flags = ["--nodes", "2", "--spares", "1", "--chaos", "kill rank=1 at=13"]
    flags += ["--env", "PEERCKPT_SNAPSHOT_EVERY=1"]
    code, log, report = _peerckpt_run(tmp_path, REPO / "examples" / "train.py", flags, EXAMPLE_ARGS)
    assert code == 0, log[-6000:]
    (event,) = report["events"]
    assert event["ranks"] == [1] and event["resumed_at"] is not None, event
    assert set(_losses(log)) == set(range(30)), log[-4000:]


@pytest.mark.slow
def test_the_example_recovers_bit_for_bit_inside_and_at_the_end_of_a_data_epoch(
    tmp_path: Path,
) -> None:
    """Three kills, each restored from the last committed step before it: every loss and
    learning rate rank 0 printed, steps trained again included, equals the fault-free run's.
    A data epoch is 4 batches and the kills 5 steps apart, so whatever steady lag the commit
    has behind the kill (1 to 3 steps), one restore lands just after an epoch's last batch
    (the loader restored exhausted) and another inside an epoch."""
    script = REPO / "examples" / "train.py"
    every = ["--env", "PEERCKPT_SNAPSHOT_EVERY=1", "--nodes", "2"]
    code, log, _ = _peerckpt_run(tmp_path / "reference", script, every, EXAMPLE_ARGS)
    assert code == 0, log[-6000:]
    reference = _losses(log)
    kills = "kill rank=1 at=12; kill rank=0 at=17; kill rank=1 at=22"
    chaos = ["--spares", "3", "--chaos", kills]
    code, log, report = _peerckpt_run(tmp_path / "chaos", script, every + chaos, EXAMPLE_ARGS)
    assert code == 0, log[-6000:]
    restored = [e["restore_step"] for e in report["events"]]
    assert len(restored) == 3, report["events"]
    assert {(step + 1) % 4 == 0 for step in restored} == {True, False}, restored
    for step, seen in _losses(log).items():
        assert seen == reference[step], f"step {step}: {seen} after restores, {reference[step]}"


@pytest.mark.slow
def test_the_readme_snippet_survives_the_readme_command(tmp_path: Path) -> None:
    """The README's "Use" code, saved as train.py, under the command below it, as written."""
    readme = (Path(REPO) / "README.md").read_text()
    use = readme[readme.index("## Use") :]
    code = use[use.index("```python\n") + 10 :]
    (tmp_path / "train.py").write_text(code[: code.index("```")])
    command = use[use.index("peerckpt run ") : use.index(" train.py\n")].split(" ", 2)[2]
    flags = [f.strip('"') for f in re.findall(r'"[^"]*"|\S+', command)]
    returncode, log, report = _peerckpt_run(tmp_path, tmp_path / "train.py", flags, [])
    assert returncode == 0, log[-6000:]
    assert [e["kind"] for e in report["events"]] == ["rank", "node"], report["events"]
