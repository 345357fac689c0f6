"""Tensor element types by name: how snapshots, manifests and plans write a dtype.

A dtype travels as torch's name without the ``torch.`` prefix (``"float32"``, ``"bfloat16"``).
The agent and the coordinator need element sizes without importing torch (:func:`itemsize`);
the rank turns names back into ``torch.dtype`` (:func:`dtype_of`, which imports torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from peerckpt.errors import StateMismatch

if TYPE_CHECKING:
    import torch

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


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype given by name ("float32", "torch.bfloat16", …)."""
    size = _ITEMSIZES.get(dtype.removeprefix("torch."))
    if size is None:
        raise StateMismatch(f"unknown dtype {dtype!r}: no element size is known for it")
    return size


def dtype_name(dtype: Any) -> str:
    """The name of a ``torch.dtype`` as peerckpt writes it."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The ``torch.dtype`` called ``name`` (imports torch: a rank's function)."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StateMismatch(f"unknown dtype {name!r} in a snapshot")
    return dtype
