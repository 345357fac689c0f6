"""The one msgpack codec of peerckpt: every control message, header, manifest and blob.

Nothing is ever unpickled: decoding yields maps, lists, scalars and bytes only, whoever sent
them. Typed messages (``peerckpt/messages.py``) are built on top of these two functions.

A snapshot's *blob* (its small non-tensor state) uses three msgpack extension types, and
nothing else: a tensor is replaced by its chunk name (``TENSOR_EXT``), a tuple keeps its type
(``TUPLE_EXT``), a numpy array travels as dtype, shape and raw bytes (``NDARRAY_EXT``). The
rank's capture makes them (``runtime/capture.py``) and its restore reads them back; every
other process sees them as opaque extension objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

TENSOR_EXT = 1
TUPLE_EXT = 2
NDARRAY_EXT = 3
Ext = msgpack.ExtType


def pack(obj: Any) -> bytes:
    """msgpack-encode ``obj`` (bytes stay bytes)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes | memoryview, ext_hook: Callable[[int, bytes], Any] | None = None) -> Any:
    """Decode msgpack without any object hooks: maps, lists, scalars and bytes only
    (``ext_hook`` turns the blob's extension types back into objects)."""
    if ext_hook is None:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False)
