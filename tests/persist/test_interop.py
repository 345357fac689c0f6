"""Durable checkpoints read by other tools: full tensors, safetensors, dcp.load."""

from __future__ import annotations

import secrets
import warnings

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from peerckpt.errors import CheckpointError
from peerckpt.manifest import META_KEY, ChunkRecord
from peerckpt.persist.durable import DurableStore
from peerckpt.persist.interop import PeerckptReader, export_safetensors, full_tensors


def _record(key: str, t: torch.Tensor, offsets, global_shape, scope="global") -> ChunkRecord:
    raw = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b""
    dtype = str(t.dtype).removeprefix("torch.")
    return ChunkRecord(
        key,
        dtype,
        tuple(global_shape),
        tuple(offsets),
        tuple(t.shape),
        0,
        len(raw),
        crc32c.crc32c(raw),
        scope,
    )


@pytest.fixture
def sharded(tmp_path):
    """A (6, 4) weight cut in uneven row shards over 3 ranks, a replicated bias, blobs."""
    torch.manual_seed(0)
    weight, bias = torch.randn(6, 4), torch.randn(4).to(torch.bfloat16)
    cuts = [(0, 3), (3, 2), (5, 1)]
    store = DurableStore(f"memory://peerckpt-interop-{secrets.token_hex(4)}/ckpt")
    layouts, pieces = {}, []
    for rank, (start, n) in enumerate(cuts):
        shard = weight[start : start + n]
        blob = torch.tensor(list(f"rank {rank}".encode()), dtype=torch.uint8)
        own = torch.tensor([float(rank + 1)])  # a per-rank tensor (a Stateful's plain one)
        records = [
            _record("model/w", shard, (start, 0), (6, 4)),
            _record("model/b", bias, (0,), (4,)),
            _record("optim/state/model.w/exp_avg", shard * 2, (start, 0), (6, 4)),
            _record("optim/state/model.w/step", own, (0,), (1,), scope="rank"),
            _record(META_KEY, blob, (0,), tuple(blob.shape), scope="rank"),
        ]
        layouts[rank] = records
        for record, t in zip(records, [shard, bias, shard * 2, own, blob], strict=True):
            pieces.append((rank, record, t.contiguous().view(torch.uint8).numpy().tobytes()))
    seen, unique = set(), []
    for rank, record, raw in pieces:  # what assign_writers would give one writer
        key = (record.key, record.scope, rank if record.scope == "rank" else None, record.offsets)
        if key not in seen:
            seen.add(key)
            unique.append((rank, record, raw))
    store.write_part(4, 0, unique)
    store.commit(4, epoch=0, layouts=layouts)
    yield store, weight, bias
    store.fs.rm(store.root, recursive=True)


def test_full_tensors_are_assembled_from_every_shard(sharded) -> None:
    store, weight, bias = sharded
    tensors = full_tensors(store.open())
    assert sorted(tensors) == ["model.b", "model.w", "optim.state.model.w.exp_avg"]
    assert torch.equal(tensors["model.w"], weight) and torch.equal(tensors["model.b"], bias)
    assert torch.equal(tensors["optim.state.model.w.exp_avg"], weight * 2)
    only = full_tensors(store.open(), prefix="model")
    assert sorted(only) == ["b", "w"]


def test_export_writes_a_safetensors_file_of_full_tensors(sharded, tmp_path) -> None:
    store, weight, bias = sharded
    out = tmp_path / "model.safetensors"
    export_safetensors(store.url, str(out), prefix="model")
    loaded = load_file(str(out))
    assert sorted(loaded) == ["b", "w"]
    assert torch.equal(loaded["w"], weight) and torch.equal(loaded["b"], bias)
    assert loaded["b"].dtype == torch.bfloat16


def test_export_and_verify_report_their_progress(sharded, tmp_path) -> None:
    store, _, _ = sharded
    seen: list[tuple[int, int]] = []
    export_safetensors(
        store.url, str(tmp_path / "m.safetensors"), progress=lambda d, n: seen.append((d, n))
    )
    assert seen == [(1, 3), (2, 3), (3, 3)]
    checked: list[tuple[int, int]] = []
    ckpt = store.open()
    assert ckpt.verify(lambda d, n: checked.append((d, n))) == []
    chunks = len(ckpt.manifest.unique_chunks())
    assert checked == [(d, chunks) for d in range(1, chunks + 1)]


def test_dcp_load_through_the_reader_equals_our_own_load(sharded) -> None:
    store, _, _ = sharded
    state = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it loads on one rank
        dcp.load(state, storage_reader=PeerckptReader(store.url))
    ours = full_tensors(store.open())
    assert torch.equal(state["model"]["w"], ours["model.w"])
    assert torch.equal(state["model"]["b"], ours["model.b"])


def test_a_corrupted_chunk_fails_dcp_load_naming_it(sharded) -> None:
    store, _, _ = sharded
    chunk = next(c for c in store.open().chunks(1) if c.record.key == "model/w")
    path = store.step_path(4, chunk.file)
    raw = bytearray(store.fs.cat_file(path))
    raw[chunk.record.byte_offset] ^= 0xFF
    store.fs.pipe_file(path, bytes(raw))
    state = {"model": {"w": torch.zeros(6, 4)}}
    # DCP wraps the reader's error (in a BaseException) with the rank it happened on.
    with (
        pytest.raises(CheckpointException, match="'model/w' of step 4 fails verification"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=PeerckptReader(store.url))


def test_peerckpt_export_command(sharded, tmp_path, capsys) -> None:
    from peerckpt.launch.cli import main

    store, weight, _ = sharded
    out = tmp_path / "all.safetensors"
    assert main(["export", store.url, "--to", "safetensors", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "wrote 3 tensors" in said
    assert torch.equal(load_file(str(out))["model.w"], weight)
    # what is not exported, and why: each rank's own tensors are no part of a full tensor
    assert (
        "left out: 1 per-rank tensor(s), each rank's own, not parts of a full tensor (optim/state/model.w/step)"
        in said
    )


def test_a_ddp_models_export_loads_into_the_plain_model(tmp_path) -> None:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    store = DurableStore(f"memory://peerckpt-interop-{secrets.token_hex(4)}/ckpt")
    # What a DDP job's snapshot holds: the wrapper's names, "module.0.weight", ...
    records, pieces = [], []
    for key, t in plain.state_dict().items():
        record = _record(f"model/module.{key}", t, (0,) * t.dim(), t.shape)
        records.append(record)
        pieces.append((0, record, t.contiguous().view(torch.uint8).numpy().tobytes()))
    store.write_part(1, 0, pieces)
    store.commit(1, epoch=0, layouts={0: records})
    try:
        out = tmp_path / "model.safetensors"
        export_safetensors(store.url, str(out), prefix="model")
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        fresh.load_state_dict(load_file(str(out)))  # strict: the same keys, no "module."
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in plain.state_dict().items())
        # Without a prefix, the names stay those dcp.load knows: {"model": ddp.state_dict()}.
        expected = sorted(f"model.module.{k}" for k in plain.state_dict())
        assert sorted(full_tensors(store.open())) == expected
    finally:
        store.fs.rm(store.root, recursive=True)


def test_an_export_with_nothing_to_write_fails_naming_what_there_is(sharded, tmp_path) -> None:
    store, _, _ = sharded
    out = tmp_path / "none.safetensors"
    with pytest.raises(CheckpointError, match="no shared tensor under prefix 'nosuch'") as exc:
        export_safetensors(store.url, str(out), prefix="nosuch")
    assert "tracked objects with tensors: model, optim" in str(exc.value)
    assert not out.exists()  # an empty file would pass for an export
