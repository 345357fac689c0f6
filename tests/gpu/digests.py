"""What "bit-exact" means for an NCCL job whose peer died mid-step."""

from __future__ import annotations

from ..conftest import JobRun, read_jsonl


def assert_bit_exact_but_the_step_in_flight(run: JobRun, reference: JobRun, at: int) -> None:
    """Every step trained again and the final state equal the fault-free run's; so does every
    other step recorded, except at most one per survivor: the step in flight when the peer
    died (epoch 0, step ``at``).

    NCCL's all-reduce is asynchronous: a survivor's CPU has queued the optimizer's step behind
    the blocked all-reduce and waits in a CUDA synchronisation (the job's digest), not in the
    collective. The abort ends the kernel, the synchronisation returns, and the job records a
    digest of what the aborted kernel left before the next step boundary discards the step
    (gloo's all-reduce raises inside backward instead). Seen on an H200, 2026-11-28."""
    expected = reference.digests()
    in_flight: dict[int, list[int]] = {}
    for path in sorted(run.out.glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        for entry in read_jsonl(path):
            if entry["digest"] in expected[(rank, entry["step"])]:
                continue
            assert entry["epoch"] == 0 and entry["step"] == at, (rank, entry)
            in_flight.setdefault(rank, []).append(entry["step"])
    assert all(len(steps) == 1 for steps in in_flight.values()), in_flight
    for key, digests in expected.items():  # every step, trained again where it was lost
        assert digests <= run.digests()[key], f"rank {key[0]} step {key[1]} never matched"
    assert run.final() == reference.final()
