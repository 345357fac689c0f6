"""Durable checkpoints for other tools: full tensors, safetensors files, and ``dcp.load``.

Names: a snapshot key ``model/module.0.weight`` (the ``ctx.track`` name, then the object's
``state_dict`` key) becomes ``model.module.0.weight``, the flattened form
``torch.distributed.checkpoint`` uses for ``{"model": model.state_dict()}``. With a
``prefix`` (``"model"``) only that object's tensors are taken, named as in its own
``state_dict``, less DistributedDataParallel's ``module.`` (``0.weight``): the keys the plain,
unwrapped model loads, which is what evaluation scripts and Hugging Face tooling expect.

Only shared tensors are exported; per-rank private state (RNG, data-loader positions) is not.
Every chunk is verified against its checksum as it is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from peerckpt.boxes import Box
from peerckpt.dtypes import dtype_of
from peerckpt.errors import CheckpointError, CorruptCheckpoint
from peerckpt.manifest import META_KEY
from peerckpt.persist.durable import DurableCheckpoint, DurableStore, StoredChunk
from peerckpt.tiling import TooFragmented, tiles

_DDP_PREFIX = "module."  # DistributedDataParallel's name for the model it wraps


def fqn(key: str, prefix: str | None = None) -> str | None:
    """The exported name of snapshot key ``key``; None if ``prefix`` excludes it."""
    if prefix is not None:
        head, _, rest = key.partition("/")
        return rest if head == prefix and rest else None
    return key.replace("/", ".")


def shared_chunks(
    ckpt: DurableCheckpoint, prefix: str | None = None
) -> dict[str, list[StoredChunk]]:
    """Every stored box of every shared tensor, once each, by exported name.

    CorruptCheckpoint if boxes of one tensor disagree on its dtype or global shape (the
    manifest passed its checksum, but no writer makes such a step)."""
    out: dict[str, dict[tuple[Any, ...], StoredChunk]] = {}
    for chunks in ckpt.manifest.ranks.values():
        for c in chunks:
            name = fqn(c.record.key, prefix)
            if c.record.scope != "global" or name is None:
                continue
            boxes = out.setdefault(name, {})
            first = next(iter(boxes.values()), c).record
            if (first.dtype, first.global_shape) != (c.record.dtype, c.record.global_shape):
                raise CorruptCheckpoint(
                    f"{name!r} of step {ckpt.step}: its stored boxes disagree on what it is "
                    f"({first.dtype} {list(first.global_shape)} and {c.record.dtype} "
                    f"{list(c.record.global_shape)}); the manifest is damaged"
                )
            boxes[(c.record.offsets, c.record.lengths)] = c
    if prefix is not None:
        out = _unwrapped(out)
    return {name: list(boxes.values()) for name, boxes in sorted(out.items())}


def _unwrapped(tensors: dict[str, Any]) -> dict[str, Any]:
    """One object's tensors named as the plain module's ``state_dict``: a model tracked
    wrapped in DistributedDataParallel has every key under ``module.``, which the unwrapped
    model (the one evaluation and Hugging Face tools build) does not know. Stripped only when
    every key has it, as ``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present``."""
    if not tensors or not all(name.startswith(_DDP_PREFIX) for name in tensors):
        return tensors
    return {name[len(_DDP_PREFIX) :]: value for name, value in tensors.items()}


def tracked_objects(ckpt: DurableCheckpoint) -> list[str]:
    """The ``ctx.track`` names with shared tensors in the step (what ``prefix`` may be)."""
    return sorted(
        {
            c.record.key.partition("/")[0]
            for chunks in ckpt.manifest.ranks.values()
            for c in chunks
            if c.record.scope == "global" and "/" in c.record.key
        }
    )


def per_rank_tensors(ckpt: DurableCheckpoint, prefix: str | None = None) -> list[str]:
    """The names of the step's per-rank tensors (each rank's own: a Stateful's plain
    tensors, the loop's carried batch), which an export of full tensors leaves out."""
    return sorted(
        {
            c.record.key
            for chunks in ckpt.manifest.ranks.values()
            for c in chunks
            if c.record.scope != "global"
            and c.record.key != META_KEY
            and (prefix is None or c.record.key.partition("/")[0] == prefix)
        }
    )


def _chunk_tensor(ckpt: DurableCheckpoint, chunk: StoredChunk) -> torch.Tensor:
    data = bytearray(ckpt.read(chunk))
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype_of(chunk.record.dtype)).reshape(chunk.record.lengths)


def full_tensors(
    ckpt: DurableCheckpoint,
    prefix: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every shared tensor of the step, whole, assembled from its boxes. ``progress`` is
    told (tensors assembled, tensors in all) after each.

    Nothing is allocated before the boxes are known to cover each tensor and to lie inside
    their files: a manifest cannot make this ask for more memory than the step holds."""
    out = {}
    tensors = shared_chunks(ckpt, prefix)
    for name, chunks in tensors.items():
        ckpt.check_extents(chunks)
        _check_cover(name, ckpt.step, chunks)
    for name, chunks in tensors.items():
        first = chunks[0].record
        full = torch.empty(tuple(first.global_shape), dtype=dtype_of(first.dtype))
        for chunk in chunks:
            r = chunk.record
            index = tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths, strict=True))
            full[index] = _chunk_tensor(ckpt, chunk)
        out[name] = full
        if progress is not None:
            progress(len(out), len(tensors))
    return out


def _check_cover(name: str, step: int, chunks: list[StoredChunk]) -> None:
    """CorruptCheckpoint unless the boxes of tensor ``name`` cover it exactly once: in time
    linear in the boxes for a given number of dimensions cut (``peerckpt/tiling.py``); it
    was a check of every pair, minutes for 20,000 boxes."""
    covered = sum(math.prod(c.record.lengths) for c in chunks)
    numel = math.prod(chunks[0].record.global_shape)
    what = f"{name!r} of step {step}: the stored boxes cover {covered} of {numel} elements"
    try:
        exact = tiles(
            [Box(c.record.offsets, c.record.lengths) for c in chunks],
            chunks[0].record.global_shape,
        )
    except TooFragmented as exc:
        raise CorruptCheckpoint(f"{what}, in boxes no writer makes ({exc})") from None
    if not exact:
        raise CorruptCheckpoint(what + (" (some overlap)" if covered == numel else ""))


def export_safetensors(
    url: str,
    out: str,
    step: int | None = None,
    prefix: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Write the full tensors of a committed step to a safetensors file; return them.
    ``progress`` is told (tensors read, tensors in all) as they are assembled."""
    from safetensors.torch import save_file

    ckpt = DurableStore(url).open(step)
    tensors = full_tensors(ckpt, prefix, progress)
    if not tensors:  # nothing to write: an empty file would pass for an export
        objects = ", ".join(tracked_objects(ckpt)) or "none"
        raise CheckpointError(
            f"step {ckpt.step} in {url} has no shared tensor"
            + (f" under prefix {prefix!r}" if prefix is not None else "")
            + f"; its tracked objects with tensors: {objects} (give one of them to --prefix, "
            "or no --prefix for every tensor)"
        )
    save_file(tensors, out, metadata={"peerckpt_step": str(ckpt.step), "source": url})
    return tensors


class PeerckptReader(StorageReader):
    """A ``torch.distributed.checkpoint`` StorageReader over a peerckpt durable checkpoint::

        dcp.load({"model": model.state_dict()}, storage_reader=PeerckptReader(url))

    DCP plans which stored boxes each rank needs (resharding as it does for its own
    format); this reader serves them, verified, from the step's data files.
    """

    def __init__(self, url: str, step: int | None = None, **storage_options: Any) -> None:
        super().__init__()
        self.url, self.step = url, step
        self._options = storage_options
        self._ckpt: DurableCheckpoint | None = None
        self._index: dict[tuple[str, tuple[int, ...]], StoredChunk] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.url = str(checkpoint_id)
        self._ckpt = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            return DurableStore(str(checkpoint_id)).latest_step() is not None
        except Exception:
            return False

    def _open(self) -> DurableCheckpoint:
        if self._ckpt is None:
            self._ckpt = DurableStore(self.url, **self._options).open(self.step)
            self._index = {
                (name, tuple(c.record.offsets)): c
                for name, chunks in shared_chunks(self._ckpt).items()
                for c in chunks
            }
        return self._ckpt

    def read_metadata(self) -> Metadata:
        ckpt = self._open()
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, tuple[str, int]] = {}
        for name, chunks in shared_chunks(ckpt).items():
            r = chunks[0].record
            state[name] = TensorStorageMetadata(
                TensorProperties(dtype=dtype_of(r.dtype)),
                torch.Size(r.global_shape),
                [
                    ChunkStorageMetadata(torch.Size(c.record.offsets), torch.Size(c.record.lengths))
                    for c in chunks
                ],
            )
            for c in chunks:
                storage[MetadataIndex(name, c.record.offsets)] = (c.file, c.record.byte_offset)
        return Metadata(state_dict_metadata=state, storage_data=storage)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *a: Any, **k: Any
    ) -> None:
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ckpt = self._open()
        cache: dict[tuple[str, int], torch.Tensor] = {}
        for req in _tensor_items(plan.items):
            key = (req.storage_index.fqn, tuple(req.storage_index.offset or ()))
            chunk = self._index.get(key)
            if chunk is None:
                raise CorruptCheckpoint(f"step {ckpt.step} has no stored box {key} for DCP")
            where = (chunk.file, chunk.record.byte_offset)
            if where not in cache:
                cache[where] = _chunk_tensor(ckpt, chunk)
            src = cache[where]
            for dim, (start, length) in enumerate(
                zip(req.storage_offsets, req.lengths, strict=True)
            ):
                src = src.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            target.copy_(src)
            planner.commit_tensor(req, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _tensor_items(items: Iterable[Any]) -> Iterable[Any]:
    for item in items:
        if item.type == LoadItemType.BYTE_IO:
            raise CorruptCheckpoint(
                f"{item.storage_index.fqn!r} is not a tensor; a peerckpt checkpoint serves "
                "tensors to dcp.load (load non-tensor state with peerckpt itself)"
            )
        yield item
