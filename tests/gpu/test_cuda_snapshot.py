"""CUDA state: copied into pinned slots on a side stream, ordered against the optimizer step,
and restored bit for bit after a rank is killed. Skipped on machines without a CUDA device
(CI has none); run on a GPU machine with ``pytest tests/gpu``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from peerckpt.runtime.capture import capture

from ..conftest import JobRun, run_job

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model_and_optim() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4096, 8192, device="cuda")  # 128 MiB of parameters
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optim


def test_cuda_state_lands_in_a_pinned_slot_before_the_optimizer_changes_it(agent_engine) -> None:
    agent, engine = agent_engine
    model, optim = _model_and_optim()
    tracked = {"model": model, "optim": optim}
    for step in (0, 1):  # register both slots first: a registration may synchronize the GPU
        engine.take(step, capture(tracked, step=step, extra={}))
        agent.wait_notices(step + 1)
        engine.on_commit(0, step)
    engine.wait_copy()
    expected = model.weight.detach().cpu().clone()
    after = expected.clone()
    # Keep the GPU busy ~0.1 s first: the snapshot's copy (on the side stream) and the change
    # below (on the training stream) both become runnable when this ends, so without the
    # ordering the change would race the copy (measured: 81% of the bytes changed).
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    # Parameters are referenced, not cloned: the copy reads them on a side stream.
    engine.take(2, capture(tracked, step=2, extra={}))
    engine.guard_step()  # what the optimizer pre-hook does; returns once the copies are queued
    with torch.no_grad():
        for _ in range(4):  # queued on the training stream at once: must run after the copy
            model.weight.add_(1.0)
            after.add_(1.0)
    notice = agent.wait_notices(3)[-1]
    assert notice.step == 2 and notice.slot == 0
    slot = engine._slots[0]
    assert slot.pinned, "the slot was not registered with CUDA"
    weight = slot.tensor[: expected.numel() * 4].view(torch.float32).view_as(expected)
    assert torch.equal(weight, expected), "the optimizer's change reached the snapshot"
    torch.cuda.synchronize()
    assert torch.equal(model.weight.detach().cpu(), after)


def test_a_clone_of_a_cuda_buffer_is_copied_as_it_was_at_the_snapshot(agent_engine) -> None:
    agent, engine = agent_engine
    buffer = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    expected = buffer.cpu()
    engine.take(0, capture({"buf": buffer}, step=0, extra={}))  # a plain tensor: cloned
    buffer.mul_(-1.0)  # changed at once on the training stream; no optimizer step in between
    agent.wait_notices(1)
    engine.wait_copy()
    slot = engine.slot_tensor(0)[: expected.numel() * 4].view(torch.float32)
    assert torch.equal(slot, expected)


def test_slots_are_unpinned_when_the_engine_closes(agent_engine) -> None:
    agent, engine = agent_engine
    engine.take(0, capture({"buf": torch.ones(1024, device="cuda")}, step=0, extra={}))
    agent.wait_notices(1)
    engine.wait_copy()
    slot = engine._slots[0]
    assert slot.pinned
    engine.close()
    assert not slot.pinned and not engine._slots


GPU_JOB = ["--steps", "30", "--device", "cuda", "--backend", "gloo"]


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    run = run_job(tmp_path_factory.mktemp("gpu-reference"), script_args=GPU_JOB)
    assert run.returncode == 0, run.log[-4000:]
    return run


def test_a_killed_gpu_rank_is_replaced_bit_exact(tmp_path, gpu_reference) -> None:
    # 2 nodes x 2 ranks, all on cuda:0 (gloo, so that ranks can share the one GPU).
    run = run_job(tmp_path, script_args=GPU_JOB, spares=1, chaos="kill rank=2 at=10")
    assert run.returncode == 0, run.log[-4000:]
    expected, got = gpu_reference.digests(), run.digests()
    assert set(got) == {(r, s) for r in range(4) for s in range(30)}
    for key, digests in got.items():
        assert digests == expected[key], f"rank {key[0]} step {key[1]} differs"
    assert run.final() == gpu_reference.final()
    [event] = run.report["events"]
    assert event["ranks"] == [2] and event["resumed_at"] is not None


def test_a_lost_gpu_node_is_rebuilt_from_peer_memory_bit_exact(tmp_path, gpu_reference) -> None:
    run = run_job(tmp_path, script_args=GPU_JOB, spares=2, chaos="kill node=1 at=12")
    assert run.returncode == 0, run.log[-4000:]
    assert run.final() == gpu_reference.final()
    [event] = run.report["events"]
    pulls = {p["rank"]: p for p in event["pulls"]}
    assert pulls[2]["source"] == 0 and pulls[2]["bytes"] > 0
