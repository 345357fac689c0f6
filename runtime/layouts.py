"""Where a rank's tensor sits inside the global tensor it is part of.

Every tensor peerckpt captures is a *box* of a global tensor: ``global_shape`` plus, per
dimension, the ``offsets`` where this rank's piece starts (its lengths are its local shape).

- A DTensor (any DeviceMesh, ``Shard(d)`` — uneven included — and ``Replicate()``; FSDP2
  parameters and their optimizer state are such DTensors) is the box DTensor itself computes
  for this rank.
- ``peerckpt.Shard(tensor, global_shape=…, offsets=…)`` declares a hand-sharded tensor (tensor
  parallelism written by hand).
- Any other tensor is a full box of itself: replicated, as data parallelism keeps it.

Nothing here talks to other ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from peerckpt.dtypes import dtype_of
from peerckpt.errors import StateMismatch
from peerckpt.manifest import ChunkRecord

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # a torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]
    compute_local_shape_and_global_offset = None  # type: ignore[assignment]


class Shard:
    """A tensor that is one box of a larger, hand-sharded global tensor.

    ``ctx.track(w=peerckpt.Shard(local, global_shape=(4096, 1024), offsets=(1024, 0)))``
    tracks rank-local ``local`` as rows 1024… of a 4096×1024 tensor; after a change of world
    size, the runtime restores into whatever ``Shard`` the new rank declares.
    """

    def __init__(
        self, tensor: torch.Tensor, global_shape: tuple[int, ...], offsets: tuple[int, ...]
    ) -> None:
        global_shape, offsets = tuple(global_shape), tuple(offsets)
        if len(global_shape) != tensor.dim() or len(offsets) != tensor.dim():
            raise StateMismatch(
                f"peerckpt.Shard: a {tensor.dim()}-d tensor needs a {tensor.dim()}-d "
                f"global_shape and offsets, got {global_shape} and {offsets}"
            )
        for dim, (off, size, total) in enumerate(
            zip(offsets, tensor.shape, global_shape, strict=True)
        ):
            if off < 0 or off + size > total:
                raise StateMismatch(
                    f"peerckpt.Shard: along dimension {dim}, rows {off}…{off + size} do not fit "
                    f"in a global size of {total}"
                )
        self.tensor = tensor
        self.global_shape = global_shape
        self.offsets = offsets


class FlatShard:
    """This rank's piece of a *flat parameter*: tensors flattened and concatenated in order,
    then cut at arbitrary element offsets, one range per rank (ZeRO, FSDP1).

    ``peerckpt.FlatShard(local, shapes={"w": (1024, 512), "b": (512,)}, start=s, stop=e)``
    says that ``local`` (1-D, ``e - s`` elements) holds elements ``s…e`` of the concatenation.
    Each tensor piece it holds is captured as regular boxes of that tensor, so a later world
    can cut the same tensors differently (or as DTensors) and still restore from it.
    """

    def __init__(
        self, local: torch.Tensor, shapes: dict[str, tuple[int, ...]], start: int, stop: int
    ) -> None:
        total = sum(math.prod(s) for s in shapes.values())
        if local.dim() != 1 or local.numel() != stop - start or not 0 <= start <= stop <= total:
            raise StateMismatch(
                f"peerckpt.FlatShard: a 1-D local tensor of {stop - start} elements must hold "
                f"elements {start}…{stop} of {total}; got shape {tuple(local.shape)}"
            )
        self.local = local
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        self.start, self.stop = start, stop

    def pieces(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]:
        """(tensor name, its global shape, box offsets, box lengths, offset in ``local``)."""
        from peerckpt.boxes import flat_shards_to_boxes

        names = list(self.shapes)
        bases, base = [], 0
        for shape in self.shapes.values():
            bases.append(base)
            base += math.prod(shape)
        found = []
        for index, box in flat_shards_to_boxes(list(self.shapes.values()), self.start, self.stop):
            shape = self.shapes[names[index]]
            strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
            flat = bases[index] + sum(o * s for o, s in zip(box.offsets, strides, strict=True))
            found.append((names[index], shape, box.offsets, box.lengths, flat - self.start))
        return found

    def view(self, offset: int, lengths: tuple[int, ...]) -> torch.Tensor:
        """The piece of ``local`` at ``offset`` shaped as a box (boxes of a range are contiguous)."""
        return self.local[offset : offset + math.prod(lengths)].view(lengths)


@dataclass(frozen=True)
class Placed:
    """A local tensor and where it sits in its global tensor."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def is_dtensor(value: object) -> TypeGuard[Any]:
    """True for a DTensor (typed as Any: its attributes are not in torch's Tensor stubs)."""
    return DTensor is not None and isinstance(value, DTensor)


def place(value: torch.Tensor | Shard) -> Placed:
    """The local data of ``value`` and its box in the global tensor."""
    if isinstance(value, Shard):
        return Placed(value.tensor.detach(), value.global_shape, value.offsets)
    if is_dtensor(value):
        assert compute_local_shape_and_global_offset is not None
        local = value.to_local().detach()
        shape, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        if tuple(shape) != tuple(local.shape):  # padded or strided layouts we do not know
            raise StateMismatch(
                f"a DTensor's local shard is {tuple(local.shape)}, its placement says "
                f"{tuple(shape)}; this layout is not supported"
            )
        return Placed(local, tuple(value.shape), tuple(int(o) for o in offsets))
    tensor = value.detach()
    return Placed(tensor, tuple(tensor.shape), (0,) * tensor.dim())


def local_of(value: torch.Tensor | Shard) -> torch.Tensor:
    """The tensor whose storage holds this rank's data (to copy into, in place)."""
    if isinstance(value, Shard):
        return value.tensor
    if is_dtensor(value):
        return value.to_local()
    return value


def chunk_view(slot: torch.Tensor, chunk: ChunkRecord) -> torch.Tensor:
    """The bytes of ``chunk`` in ``slot`` (a uint8 tensor) as a tensor of its dtype and local
    shape, without copying."""
    raw = slot[chunk.byte_offset : chunk.byte_offset + chunk.nbytes]
    return raw.view(dtype_of(chunk.dtype)).view(chunk.lengths)
