"""The words of a recovery plan: held and wanted chunks, reads, element sizes, the storage tier.

Shared by the planner's modules (``recovery/planner.py`` re-exports them) and by the ranks'
agents that carry plans out. Plain data, no logic beyond a lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from peerckpt.errors import StateMismatch
from peerckpt.recovery.chunks import Box

_ITEMSIZES: dict[str, int] = {
    **dict.fromkeys(["bool", "uint8", "int8", "qint8", "quint8", "quint4x2", "quint2x4"], 1),
    **dict.fromkeys(["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"], 1),
    **dict.fromkeys(["float8_e8m0fnu", "float4_e2m1fn_x2", "bit", "bits8", "bits1x8"], 1),
    **dict.fromkeys(["bits2x4", "bits4x2"], 1),
    # Sub-byte integer dtypes take a byte per element in torch's storage.
    **dict.fromkeys([f"{kind}{bits}" for kind in ("int", "uint") for bits in range(1, 8)], 1),
    **dict.fromkeys(["float16", "half", "bfloat16", "int16", "short", "uint16", "bits16"], 2),
    **dict.fromkeys(["float32", "float", "int32", "int", "uint32", "qint32"], 4),
    **dict.fromkeys(["complex32", "chalf"], 4),
    **dict.fromkeys(["float64", "double", "int64", "long", "uint64", "complex64", "cfloat"], 8),
    **dict.fromkeys(["complex128", "cdouble"], 16),
}
STORAGE = -1  # the durable tier as a holder: read only where no memory copy survived


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype given by name ("float32", "torch.bfloat16", …)."""
    size = _ITEMSIZES.get(dtype.removeprefix("torch."))
    if size is None:
        raise StateMismatch(f"unknown dtype {dtype!r}: no element size is known for it")
    return size


@dataclass(frozen=True, slots=True)
class HeldChunk:
    """A chunk in an old rank's committed snapshot: ``box`` of tensor ``key``."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box


@dataclass(frozen=True, slots=True)
class WantedChunk:
    """A box of tensor ``key`` that a new rank needs to restore."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box


class Read(NamedTuple):
    """Copy ``region`` of ``key`` from chunk ``src_box`` of old rank ``source_rank``'s snapshot,
    as stored on ``source_node``, into the new rank's chunk ``dst_box``.

    ``region`` lies in both boxes (global coordinates); ``nbytes`` is its size. A read whose
    ``source_node`` is the new rank's own node needs no network.
    """

    source_node: int
    source_rank: int
    key: str
    src_box: Box
    dst_box: Box
    region: Box
    nbytes: int


# Read((...)) without the named tuple's Python-level __new__: plans make millions of them.
new_read = partial(tuple.__new__, Read)
