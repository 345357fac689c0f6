"""Whole jobs that write durable checkpoints in the background while they train."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import stat
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import load_file

from peerckpt.manifest import META_KEY
from peerckpt.persist.durable import DurableStore
from peerckpt.persist.interop import PeerckptReader, export_safetensors
from peerckpt.runtime import restore

from .conftest import (
    JOBS,
    assert_same_digests,
    launch,
    read_jsonl,
    run_job,
    run_with_reference,
)


def _ddp_job():
    spec = importlib.util.spec_from_file_location("ddp_job", JOBS / "ddp_job.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _digest_from_checkpoint(job, ckpt, rank: int) -> str:
    """Rebuild rank ``rank``'s model and optimizer from the checkpoint alone; their digest."""
    return str(job.digest(*_restore_from_checkpoint(job, ckpt, rank)))


def _restore_from_checkpoint(job, ckpt, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    image, records = ckpt.slot_image(rank)
    slot = torch.frombuffer(image, dtype=torch.uint8)
    holder = nn.Module()
    holder.module = job.build()  # the same state_dict keys as the job's DDP wrapper
    optim = torch.optim.AdamW(holder.parameters(), lr=1e-3)
    objs = {"model": holder, "optim": optim}
    meta = restore.read_meta(slot, next(r for r in records if r.key == META_KEY))
    source = restore.ChunkSource(records, slot=slot)
    restore.restore_objects(objs, objs, source, {rank: meta}, rank, rank, 4, resharded=False)
    assert meta["step"] == ckpt.step
    return holder, optim


def test_a_job_flushes_committed_steps_that_reload_bit_exact(tmp_path) -> None:
    url = f"file://{tmp_path}/ckpt"
    run = run_job(
        tmp_path,
        script_args=["--steps", "22", "--sleep", "0.02"],
        extra=["--persist", url, "--persist-every", "5", "--keep", "2", "--persist-mode", "0640"],
    )
    assert run.returncode == 0, run.log[-4000:]
    flushed = [f["step"] for f in run.report["flushes"] if f["state"] == "committed"]
    # Every 5 steps, and the last step (21) as the job ends.
    assert flushed[-1] == 21 and flushed[:-1] and all(s % 5 == 0 for s in flushed[:-1])
    store = DurableStore(url)
    assert store.committed_steps() == flushed[-2:]  # keep=2
    assert store.all_steps() == flushed[-2:]  # nothing half-written left behind
    # Every file the agents and the coordinator wrote has the mode asked for (default 0600).
    root = tmp_path / "ckpt"
    modes = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}
    assert {m for p, m in modes.items() if p == "ckpt" or p.startswith("step-")} == {0o750}
    assert {m for p, m in modes.items() if p != "ckpt" and not p.startswith("step-")} == {0o640}
    assert _assert_committed_steps_reload(url, tmp_path) == flushed[-2:]
    # Other tools read the same bits: a safetensors export and dcp.load through the reader.
    job = _ddp_job()
    model, _ = _restore_from_checkpoint(job, store.open(), 0)
    ours = model.state_dict()  # as the job's DDP wrapper names them: module.0.weight, …
    export_safetensors(url, str(tmp_path / "m.safetensors"), prefix="model")
    exported = load_file(str(tmp_path / "m.safetensors"))
    # The export loads into the plain, unwrapped model: DDP's "module." is not in its keys.
    plain = job.build()
    plain.load_state_dict(exported)  # strict: every key present, none left over
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in model.module.state_dict().items())
    assert all(torch.equal(exported[k.removeprefix("module.")], v) for k, v in ours.items())
    state = {"model": {k: torch.zeros_like(v) for k, v in ours.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group here: DCP loads as one rank
        dcp.load(state, storage_reader=PeerckptReader(url))
    assert all(torch.equal(state["model"][k], v) for k, v in ours.items())


def test_the_last_committed_step_is_made_durable_when_the_job_ends(tmp_path) -> None:
    url = f"file://{tmp_path}/ckpt"
    run = run_job(
        tmp_path, script_args=["--steps", "30"], extra=["--persist", url, "--persist-every", "7"]
    )
    assert run.returncode == 0, run.log[-4000:]
    store = DurableStore(url)
    assert store.latest_step() == 29  # 28 is the last multiple of 7; 29 the job's last step
    assert "flushing its last committed step, 29" in run.log
    job, logged = _ddp_job(), _logged_digests(tmp_path)
    ckpt = store.open()
    assert ckpt.verify() == []
    for rank in range(4):
        assert _digest_from_checkpoint(job, ckpt, rank) == logged[(rank, 29)]


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("bogus://x/ckpt", "has an unknown scheme 'bogus'"),
        ("/proc/peerckpt/ckpt", "is not writable: [Errno 2] No such file or directory"),
        ("{tmp}/a-file/ckpt", "is not writable: [Errno 20] Not a directory"),
    ],
)
def test_a_persist_location_that_cannot_work_is_refused_before_anything_starts(
    tmp_path, where: str, why: str
) -> None:
    # Root may write anywhere else, so "unwritable" is a path under /proc or under a file.
    (tmp_path / "a-file").write_text("not a directory")
    url = where.format(tmp=tmp_path)
    run = run_job(tmp_path / "out", script_args=["--steps", "5"], extra=["--persist", url])
    assert run.returncode == 2, run.log[-4000:]
    assert f"peerckpt: storage URL {url!r} {why}" in run.log, run.log[-4000:]
    assert "coordinator" not in run.log  # refused before any process started
    assert not (tmp_path / "out" / "report.json").exists()


def test_a_scripts_persist_location_that_cannot_work_fails_the_job_at_once(tmp_path) -> None:
    # @resilient(persist=...) is known only inside the ranks: the coordinator checks it when
    # rank 0 announces it, before the first epoch opens (it used to hang the job).
    run = run_job(
        tmp_path, script_args=["--steps", "5", "--persist", "bogus://x/ckpt"], timeout=120
    )
    assert run.returncode == 1, run.log[-4000:]
    assert run.report["state"] == "failed"
    assert "storage URL 'bogus://x/ckpt' has an unknown scheme 'bogus'" in run.report["reason"]
    assert not read_jsonl(tmp_path / "rank0.jsonl"), "no step was trained"


# make test: the job's end flushes its last committed step (above); Ctrl-C's stop and
# cleanup in tests/test_jobs.py
@pytest.mark.slow
def test_ctrl_c_makes_the_last_committed_step_durable_before_the_job_stops(tmp_path) -> None:
    url = f"file://{tmp_path}/ckpt"
    proc = launch(
        tmp_path,
        script_args=["--steps", "2000", "--sleep", "0.05"],
        extra=["--persist", url, "--persist-every", "100"],
    )
    try:
        _wait_for_lines(tmp_path / "rank0.jsonl", 12, proc)
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the launcher stops the job and cleans up
        log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, log[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["state"] == "interrupted"
    step = DurableStore(url).latest_step()
    # Steps 0 and 100 are the periodic flushes; the signal came at about step 12.
    assert step is not None and 0 < step < 100, log[-4000:]
    assert [f["step"] for f in report["flushes"] if f["state"] == "committed"][-1] == step
    assert "once the last committed step is durable" in log
    job, logged = _ddp_job(), _logged_digests(tmp_path)
    ckpt = DurableStore(url).open()
    for rank in range(4):
        assert _digest_from_checkpoint(job, ckpt, rank) == logged[(rank, step)]


def _wait_for_lines(path: Path, count: int, proc: subprocess.Popen[str]) -> None:
    """Until ``path`` has ``count`` lines (steps a rank logged); fails if the job ends first."""
    deadline = time.monotonic() + 180.0
    while not path.exists() or path.read_text().count("\n") < count:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the job logged fewer than {count} steps (exit status {proc.poll()})")
        time.sleep(0.2)


def test_a_job_whose_every_flush_failed_fails_naming_the_storage_error(tmp_path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / ".peerckpt-faults").write_text("eio step=*\n")  # every write of every step fails
    url = f"faulty://{root}"
    run = run_job(
        tmp_path, script_args=["--steps", "12"], extra=["--persist", url, "--persist-every", "5"]
    )
    assert run.returncode == 1, run.log[-4000:]
    assert [f["state"] for f in run.report["flushes"]] == ["failed"] * len(run.report["flushes"])
    assert [f["step"] for f in run.report["flushes"]][-1] == 11  # the last step was tried too
    reason = run.report["reason"]
    assert f"no step was made durable in {url}: " in reason, reason
    assert "Input/output error" in reason, reason
    assert DurableStore(url).committed_steps() == []


def _logged_digests(out) -> dict[tuple[int, int], str]:
    return {
        (rank, entry["step"]): entry["digest"]
        for rank in range(4)
        for entry in read_jsonl(out / f"rank{rank}.jsonl")
    }


def _assert_committed_steps_reload(url: str, out) -> list[int]:
    store = DurableStore(url)
    job, logged = _ddp_job(), _logged_digests(out)
    committed = store.committed_steps()
    for step in committed:
        ckpt = store.open(step)
        assert ckpt.verify() == []
        for rank in range(4):
            assert _digest_from_checkpoint(job, ckpt, rank) == logged[(rank, step)]
    return committed


def test_a_full_disk_mid_flush_warns_keeps_training_and_the_next_flush_succeeds(tmp_path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    # Step 10's data files hit a full disk part way; step 15 cannot write a byte.
    (root / ".peerckpt-faults").write_text("enospc step=10 after=50000\nenospc step=15 after=0\n")
    url = f"faulty://{root}"
    run = run_job(
        tmp_path,
        script_args=["--steps", "22", "--sleep", "0.02"],
        extra=["--persist", url, "--persist-every", "5"],
    )
    assert run.returncode == 0, run.log[-4000:]
    states = {f["step"]: f for f in run.report["flushes"]}
    for step in (10, 15):
        assert states[step]["state"] == "failed"
        assert "No space left on device" in states[step]["error"]
    assert "flush of step 10 failed" in run.log and "training goes on" in run.log
    committed = _assert_committed_steps_reload(url, tmp_path)
    assert 10 not in committed and 15 not in committed
    assert {0, 5, 20} <= set(committed)  # before the fault, and the next one after it
    assert DurableStore(url).latest_step() == max(committed)


@pytest.mark.slow  # make test: tests/persist/test_durable.py (a step missing a writer never commits)
def test_a_writer_killed_mid_flush_never_commits_that_step(tmp_path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    # Every write of step 10 takes 1.5 s, so node 1 dies with its share half written.
    (root / ".peerckpt-faults").write_text("slow step=10 delay=1.5\n")
    url = f"faulty://{root}"
    run = run_job(
        tmp_path,
        script_args=["--steps", "200", "--sleep", "0.02"],
        spares=2,
        chaos="kill node=1 at=12",
        extra=["--persist", url, "--persist-every", "5"],
    )
    assert run.returncode == 0, run.log[-4000:]
    states = {f["step"]: f for f in run.report["flushes"]}
    assert states[10]["state"] == "failed" and "node 1" in states[10]["error"]
    committed = _assert_committed_steps_reload(url, tmp_path)
    assert 10 not in committed and 5 in committed
    assert max(committed) > 12  # flushes went on after the recovery
    store = DurableStore(url)
    assert 10 in store.all_steps()  # the partial step is there, and never loaded
    assert store.open().step == max(committed)


@pytest.mark.slow  # make test keeps the partial fallback and the no-durable case
def test_losing_every_memory_copy_falls_back_to_the_durable_step_bit_exact(tmp_path) -> None:
    # Both nodes die at once: every rank and every replica is gone. With a durable tier the
    # spares restore its latest step and train the rest again, reaching the same bits.
    url = f"file://{tmp_path}/ckpt"
    reference, run = run_with_reference(
        tmp_path,
        ["--steps", "25", "--sleep", "0.02"],
        spares=4,
        chaos="kill node=0 at=12; kill node=1 at=12",
        extra=["--persist", url, "--persist-every", "5"],
    )
    assert run.returncode == 0, run.log[-4000:]
    fallbacks = [e for e in run.report["events"] if e.get("fallback")]
    assert len(fallbacks) == 1 and "no surviving copy" in fallbacks[0]["fallback"]
    restored = fallbacks[0]["restore_step"]
    assert restored in (5, 10)  # the latest durable step when the nodes died
    assert {p["source"] for p in fallbacks[0]["pulls"]} == {-1}
    assert "no memory copy survived" in run.log
    assert_same_digests(run, reference)


def test_state_with_no_memory_copy_left_is_read_from_storage_and_the_rest_from_peers(
    tmp_path,
) -> None:
    # 3 nodes x 1 rank, one replica each (ring: node 0 -> 1 -> 2 -> 0). Every rank waits at
    # step 12, after step 11 was committed and flushed; then nodes 0 and 1 die together. Rank
    # 0's copies (nodes 0 and 1) are gone; ranks 1 and 2 survive on node 2. The durable step is
    # the committed step, so only what node 2 lacks comes from storage — rank 0's own state
    # (the model and optimizer are the same on every DDP rank, and node 2 has them) — and no
    # step is trained again.
    url = f"file://{tmp_path}/ckpt"
    # the reference without the pause, which changes no bit: 6 s less of make test
    reference = run_job(tmp_path / "reference", script_args=["--steps", "20"], nodes=3, nproc=1)
    assert reference.returncode == 0, reference.log[-4000:]
    run = run_job(
        tmp_path / "chaos",
        script_args=["--steps", "20", "--pause-at", "12", "--pause-s", "6"],
        nodes=3,
        nproc=1,
        spares=2,
        chaos="kill node=0 at=12 after=3; kill node=1 at=12 after=3",
        extra=["--persist", url, "--persist-every", "11"],
    )
    assert run.returncode == 0, run.log[-4000:]
    [event] = [e for e in run.report["events"] if e.get("fallback")]
    assert event["partial"] and event["restore_step"] == 11, event
    pulls = event["pulls"]
    storage = {p["rank"]: p["bytes"] for p in pulls if p["source"] == -1}
    memory = {p["rank"]: p["bytes"] for p in pulls if p["source"] == 2}
    # Every rank reads rank 0's own state (each gets every old rank's, to reshard Stateful
    # objects), and that alone comes from storage: a few KB; the model and optimizer, from
    # node 2's memory, are 15 times as much.
    assert set(storage) == set(memory) == {0, 1, 2}, pulls
    assert len(set(storage.values())) == 1, pulls
    assert all(storage[r] * 10 < memory[r] for r in storage), pulls
    assert "reading what was lost from there and the rest from memory" in run.log
    steps = [e["step"] for e in read_jsonl(tmp_path / "chaos" / "rank0.jsonl")]
    assert steps == list(range(20)), "a step was trained twice or skipped"
    assert_same_digests(run, reference)


@pytest.mark.slow  # make test keeps the partial fallback and the no-durable case
def test_a_replica_corrupted_in_memory_is_never_restored_and_storage_is_used(tmp_path) -> None:
    # Rank 2's only other copy (node 0's replica) gets a flipped byte, then its node dies.
    # The pull fails its checksum; the job goes back to the durable step, and ends bit-exact.
    url = f"file://{tmp_path}/ckpt"
    reference, run = run_with_reference(
        tmp_path,
        ["--steps", "25", "--sleep", "0.02"],
        spares=2,
        chaos="corrupt rank=2 at=12; kill node=1 at=12",
        extra=["--persist", url, "--persist-every", "5"],
    )
    assert run.returncode == 0, run.log[-4000:]
    [corrupt] = [c for c in run.report["chaos"] if c["kind"] == "corrupt_rank"]
    assert corrupt["segments"] and all("-n0-r2-" in s for s in corrupt["segments"])
    [event] = [e for e in run.report["events"] if e.get("fallback")]
    assert "no valid copy of rank 2" in event["fallback"] and "checksum" in event["fallback"]
    assert {p["source"] for p in event["pulls"]} == {-1}  # memory is not trusted for it
    assert_same_digests(run, reference)


# make test: the loss of every copy without a durable tier, named (below); a corrupted replica
# refused by its checksum in tests/replication
@pytest.mark.slow
def test_a_corrupted_only_copy_without_a_durable_tier_stops_naming_rank_and_cause(
    tmp_path,
) -> None:
    run = run_job(
        tmp_path,
        script_args=["--steps", "25", "--sleep", "0.02"],
        spares=2,
        chaos="corrupt rank=2 at=12; kill node=1 at=12",
    )
    assert run.returncode == 1
    reason = run.report["reason"]
    assert "no valid copy of rank 2" in reason and "checksum" in reason, reason


def test_losing_every_memory_copy_without_a_durable_tier_names_what_was_lost(tmp_path) -> None:
    run = run_job(
        tmp_path,
        script_args=["--steps", "25", "--sleep", "0.02"],
        spares=4,
        chaos="kill node=0 at=12; kill node=1 at=12",
    )
    assert run.returncode == 1
    # Which ranks it names depends on which node's loss was handled first; either way every
    # copy of them is gone, and the error says so and what would have saved them.
    reason = run.report["reason"]
    lost = r"no surviving copy of the committed snapshot of rank\(s\) \[[0-3, ]+\]"
    assert re.search(lost, reason), reason
    assert "--replicas" in reason and "persist=" in reason
