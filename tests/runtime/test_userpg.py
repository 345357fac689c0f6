"""A script's own ``init_process_group``/``destroy_process_group`` under peerckpt
(``runtime/userpg.py``): harmless inside an epoch, an error where they contradict it."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from peerckpt.errors import ConfigurationError
from peerckpt.runtime import userpg


@pytest.fixture(autouse=True)
def torchs_own_afterwards(monkeypatch) -> None:
    """Every test here installs the replacements: torch's own names come back after it."""
    monkeypatch.setattr(dist, "init_process_group", userpg.ORIGINAL_INIT)
    monkeypatch.setattr(dist, "destroy_process_group", userpg.ORIGINAL_DESTROY)
    monkeypatch.setattr(dist, "get_rank", userpg.ORIGINAL_GET_RANK)
    monkeypatch.setattr(dist, "get_world_size", userpg.ORIGINAL_GET_WORLD_SIZE)
    monkeypatch.setattr(userpg, "_said", set())
    monkeypatch.setattr(userpg, "_scanned", set())


@pytest.fixture
def one_rank_group(tmp_path) -> Iterator[None]:
    userpg.ORIGINAL_INIT("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    userpg.ORIGINAL_DESTROY()


def test_the_scripts_calls_do_nothing_inside_an_epoch(one_rank_group, caplog) -> None:
    userpg.install(lambda: "gloo")
    with caplog.at_level("INFO", logger="peerckpt.rank"):
        dist.init_process_group(backend="gloo", world_size=1, rank=0)  # as torchrun scripts do
        dist.destroy_process_group()
    assert dist.is_initialized() and dist.get_world_size() == 1  # peerckpt's group stays
    assert "peerckpt already formed this epoch's group (gloo, rank 0 of 1)" in caplog.text


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (dict(backend="nccl"), "pass @peerckpt.resilient(backend='nccl')"),
        (dict(world_size=4), "this epoch has 1 rank(s)"),
        (dict(rank=3), "this process is rank 0 in this epoch"),
    ],
)
def test_a_call_that_contradicts_the_epoch_names_the_fix(one_rank_group, call, message) -> None:
    userpg.install(lambda: "gloo")
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dist.init_process_group(**call)


def test_names_a_module_bound_to_torchs_functions_are_rebound() -> None:
    """``from torch.distributed import init_process_group`` at the top of a file binds torch's
    own function before peerckpt is imported (the PyTorch DDP tutorial does)."""
    module = types.ModuleType("users_trainer")
    module.init_process_group = userpg.ORIGINAL_INIT  # type: ignore[attr-defined]
    module.destroy_process_group = userpg.ORIGINAL_DESTROY  # type: ignore[attr-defined]
    sys.modules["users_trainer"] = module
    try:
        userpg.install(lambda: "gloo")
        assert module.init_process_group is userpg.init_process_group  # type: ignore[attr-defined]
        assert module.destroy_process_group is userpg.destroy_process_group  # type: ignore[attr-defined]
    finally:
        del sys.modules["users_trainer"]


@pytest.mark.parametrize(
    ("asked", "formed", "ok"),
    [
        ("gloo", "gloo", True),
        ("nccl", "cpu:gloo,cuda:nccl", True),
        ("gloo", "cpu:gloo,cuda:nccl", False),  # CUDA tensors would not go through gloo
        ("nccl", "gloo", False),
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", True),
    ],
)
def test_which_backends_a_script_may_ask_for(asked, formed, ok) -> None:
    assert userpg._compatible(asked, formed) is ok


def test_a_module_holding_unhashable_values_is_scanned_all_the_same() -> None:
    module = types.ModuleType("holds_a_buffer")
    module.buffer = memoryview(bytearray(8))  # type: ignore[attr-defined]  # unhashable
    module.init_process_group = userpg.ORIGINAL_INIT  # type: ignore[attr-defined]
    sys.modules["holds_a_buffer"] = module
    try:
        userpg.install(lambda: "gloo")
        assert module.init_process_group is userpg.init_process_group  # type: ignore[attr-defined]
    finally:
        del sys.modules["holds_a_buffer"]


def test_rank_and_world_size_before_any_group_come_from_the_environment(
    monkeypatch, tmp_path, caplog
) -> None:
    """A script's top level after its own init_process_group (Lightning Fabric, Accelerate)
    asks for its rank: peerckpt has formed no group yet, RANK and WORLD_SIZE answer; inside
    an epoch torch's group does; outside a job, torch's error as before."""
    userpg.install(lambda: "gloo")
    module = types.ModuleType("a_script")
    exec("from torch.distributed import get_rank, get_world_size", module.__dict__)
    sys.modules["a_script"] = module
    try:
        userpg.install(lambda: "gloo")
        assert module.get_rank is userpg.get_rank
        monkeypatch.delenv("PEERCKPT_JOB", raising=False)
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            dist.get_rank()
        monkeypatch.setenv("PEERCKPT_JOB", "job")
        monkeypatch.setenv("RANK", "3")
        monkeypatch.setenv("WORLD_SIZE", "4")
        with caplog.at_level("INFO", logger="peerckpt.rank"):
            dist.init_process_group("gloo")
            assert (dist.get_rank(), module.get_world_size()) == (3, 4)
        assert "the answer is RANK from the environment (3)" in caplog.text
        userpg.ORIGINAL_INIT("gloo", init_method=f"file://{tmp_path / 's'}", rank=0, world_size=1)
        try:
            assert (dist.get_rank(), dist.get_world_size()) == (0, 1)  # the group's, not RANK
        finally:
            userpg.ORIGINAL_DESTROY()
    finally:
        del sys.modules["a_script"]


@pytest.mark.parametrize("name", ["barrier", "all_reduce", "broadcast_object_list", "send"])
def test_a_collective_before_the_function_is_refused_naming_where_it_belongs(
    monkeypatch, name
) -> None:
    # torchvision's init_distributed_mode: init_process_group, then a barrier at once. torch's
    # own said "Default process group has not been initialized, please make sure to call
    # init_process_group", which the script had just done.
    from peerckpt.runtime import usercoll

    call = usercoll.REPLACED[name]
    args: dict[str, tuple[object, ...]] = {
        "barrier": (),
        "all_reduce": (torch.ones(2),),
        "broadcast_object_list": ([1],),
        "send": (torch.ones(2), 1),
    }
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        call(*args[name])  # outside a job: torch's own error
    monkeypatch.setenv("PEERCKPT_JOB", "j")
    with pytest.raises(ConfigurationError) as refused:
        call(*args[name])
    said = str(refused.value)
    assert said.startswith(f"dist.{name}() before the decorated function runs")
    assert f"Move the {name}() into the decorated function, before ctx.track" in said
