"""Checked reads of decoded msgpack values: the edge where untrusted input becomes typed fields.

A manifest that passes its checksum is still only bytes somebody wrote: a damaged writer, an
older or newer peerckpt, or someone with write access to the storage. Every field is taken
through one of these functions, which return it with its Python type and range checked or
raise :class:`MalformedManifest` naming the field. They allocate nothing beyond the value
itself, so a decoder built from them never asks for more memory than its input justifies.

Pure functions; no I/O.
"""

from __future__ import annotations

from typing import Any

from peerckpt.errors import MalformedManifest

# Sizes, offsets and counts fit a signed 64-bit integer (what torch and the OS take).
MAX_INT = (1 << 63) - 1
MAX_DIMS = 64  # more dimensions than any tensor torch can make


def need_map(value: Any, what: str) -> dict[Any, Any]:
    """``value`` as a map, or MalformedManifest."""
    if not isinstance(value, dict):
        raise MalformedManifest(f"{what} must be a map, not {_kind(value)}")
    return value


def need_list(value: Any, what: str, length: int | None = None) -> list[Any]:
    """``value`` as a list (of ``length`` items when given), or MalformedManifest."""
    if not isinstance(value, (list, tuple)):
        raise MalformedManifest(f"{what} must be a list, not {_kind(value)}")
    if length is not None and len(value) != length:
        raise MalformedManifest(f"{what} must have {length} items, not {len(value)}")
    return list(value)


def need_int(value: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """``value`` as an integer in [lo, hi] (booleans refused), or MalformedManifest."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedManifest(f"{what} must be an integer, not {_kind(value)}")
    if not lo <= value <= hi:
        raise MalformedManifest(f"{what} is {value}, outside [{lo}, {hi}]")
    return value


def need_str(value: Any, what: str) -> str:
    """``value`` as a string, or MalformedManifest."""
    if not isinstance(value, str):
        raise MalformedManifest(f"{what} must be a string, not {_kind(value)}")
    return value


def need_dims(value: Any, what: str) -> tuple[int, ...]:
    """``value`` as a tuple of non-negative integers, one per dimension."""
    items = need_list(value, what)
    if len(items) > MAX_DIMS:
        raise MalformedManifest(f"{what} has {len(items)} dimensions, more than {MAX_DIMS}")
    return tuple(need_int(v, f"{what}[{i}]") for i, v in enumerate(items))


def need_one_of(value: Any, what: str, choices: tuple[str, ...]) -> str:
    """``value`` as one of the strings ``choices``, or MalformedManifest."""
    if value not in choices:
        raise MalformedManifest(f"{what} must be one of {list(choices)}, not {value!r:.60}")
    return str(value)


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"
