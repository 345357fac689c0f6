"""State capture and restore: tracked objects ⇄ tensor chunks plus one msgpack blob.

``capture`` walks what the user passed to ``ctx.track``: modules (their state_dict),
optimizers (state keyed by parameter FQN, never by index), plain tensors, anything with
``state_dict()/load_state_dict()``, plus the RNG states the runtime tracks on its own. Every
tensor becomes a chunk (copied into the slot in the background); everything else goes into
a *skeleton* of dicts, lists and scalars where each tensor is replaced by a reference to its
chunk, encoded with msgpack extension types. ``restore`` does the inverse into the objects of
the new epoch. Nothing is pickled, and restored values are bit-identical to the captured ones.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from peerckpt.errors import StateMismatch
from peerckpt.persist.manifest import META_KEY, ChunkRecord, align

try:
    import numpy as np
except ImportError:  # numpy is optional for the training process
    np = None  # type: ignore[assignment]

_TENSOR_EXT = 1
_TUPLE_EXT = 2
_NDARRAY_EXT = 3
_SCALARS = (type(None), bool, int, float, str, bytes)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StateMismatch(f"unknown dtype {name!r} in a snapshot")
    return dtype


@dataclass
class Captured:
    """One snapshot's worth of state: tensors to copy and the encoded blob."""

    tensors: list[tuple[str, torch.Tensor]]
    blob: bytes


class _Flattener:
    """Replaces tensors by chunk references. A tensor is kept by reference (copied later, in
    the background) only if its data pointer is in ``live``; any other is cloned now."""

    def __init__(self, live: set[int] | None) -> None:
        self.live = live
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def walk(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach()
            if self.live is not None and tensor.data_ptr() not in self.live:
                tensor = tensor.clone()
            self.tensors.append((path, tensor))
            return msgpack.ExtType(_TENSOR_EXT, path.encode())
        if isinstance(obj, dict):
            return {k: self.walk(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self.walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return msgpack.ExtType(_TUPLE_EXT, msgpack.packb(items, use_bin_type=True))
        if np is not None and isinstance(obj, np.ndarray):
            meta = [obj.dtype.str, list(obj.shape), obj.tobytes()]
            return msgpack.ExtType(_NDARRAY_EXT, msgpack.packb(meta, use_bin_type=True))
        if np is not None and isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, _SCALARS):
            return obj
        raise StateMismatch(
            f"cannot snapshot a {type(obj).__name__} at {path!r}: tracked state may hold "
            "tensors, numbers, strings, bytes, lists, tuples and dicts; convert it in state_dict()"
        )


def _ext_hook(tensors: dict[str, torch.Tensor] | None) -> Any:
    def hook(code: int, data: bytes) -> Any:
        if code == _TENSOR_EXT:
            key = data.decode()
            if tensors is None:
                return key
            if key not in tensors:
                raise StateMismatch(f"the snapshot's metadata refers to a missing chunk {key!r}")
            return tensors[key]
        if code == _TUPLE_EXT:
            return tuple(msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False))
        if code == _NDARRAY_EXT and np is not None:
            dtype, shape, raw = msgpack.unpackb(data, raw=False)
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
        raise StateMismatch(f"unknown msgpack extension {code} in a snapshot")

    return hook


def param_fqns(tracked: dict[str, Any]) -> dict[int, str]:
    """id(parameter) → "<tracked name>.<fqn>" for every tracked module."""
    names: dict[int, str] = {}
    for name, obj in tracked.items():
        if isinstance(obj, torch.nn.Module):
            for fqn, param in obj.named_parameters():
                names.setdefault(id(param), f"{name}.{fqn}")
    return names


def _optimizer_state(optim: torch.optim.Optimizer, fqns: dict[int, str]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    groups = []
    for group in optim.param_groups:
        names = []
        for param in group["params"]:
            fqn = fqns.get(id(param))
            if fqn is None:
                raise StateMismatch(
                    "an optimizer parameter belongs to no tracked module; track the model in "
                    "the same call, e.g. ctx.track(model=model, optim=optim)"
                )
            names.append(fqn)
            if param in optim.state:
                state[fqn] = dict(optim.state[param])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


def _load_optimizer(
    optim: torch.optim.Optimizer, saved: dict[str, Any], fqns: dict[int, str]
) -> None:
    index: dict[str, int] = {}
    for group in optim.param_groups:
        for param in group["params"]:
            index[fqns[id(param)]] = len(index)
    missing = [n for g in saved["param_groups"] for n in g["params"] if n not in index]
    if missing or len(saved["param_groups"]) != len(optim.param_groups):
        raise StateMismatch(
            f"the optimizer being restored does not match the snapshot (unknown parameters "
            f"{missing[:3]}); build the model and optimizer the same way in every epoch"
        )
    # Clone: Optimizer.load_state_dict keeps same-dtype tensors as they are, and the slot's
    # memory must never become live optimizer state.
    state = {
        index[n]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for n, s in saved["state"].items()
    }
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]
    optim.load_state_dict({"state": state, "param_groups": groups})


def capture_rng() -> dict[str, Any]:
    """The RNG states of torch, Python's random and numpy (and CUDA when in use)."""
    version, internal, gauss = random.getstate()
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "python": [version, list(internal), gauss],
    }
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        rng["numpy"] = [name, np.asarray(keys).tobytes(), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(rng["torch"]), dtype=torch.uint8))
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    if np is not None and "numpy" in rng:
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state(
            (name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached)
        )
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in rng["cuda"]]
        )


def _stable_pointers(tracked: dict[str, Any]) -> set[int]:
    """Data pointers of tensors that change only inside ``optimizer.step()``: parameters of a
    tracked optimizer, and frozen parameters (``requires_grad=False``)."""
    pointers: set[int] = set()
    for obj in tracked.values():
        if isinstance(obj, torch.optim.Optimizer):
            pointers.update(p.data_ptr() for g in obj.param_groups for p in g["params"])
        elif isinstance(obj, torch.nn.Module):
            pointers.update(p.data_ptr() for p in obj.parameters() if not p.requires_grad)
    return pointers


def capture(tracked: dict[str, Any], step: int, extra: dict[str, Any]) -> Captured:
    """Capture every tracked object.

    Optimizer state and the parameters it updates are referenced, not copied: the copy into
    the slot runs in the background and ``optimizer.step()`` waits for it. Every other tensor
    (buffers, parameters no tracked optimizer owns, plain tensors, Stateful state) may change
    anywhere in the next iteration, so it is cloned here.
    """
    stable = _Flattener(live=_stable_pointers(tracked))
    fqns = param_fqns(tracked)
    objects: dict[str, Any] = {}
    for name, obj in tracked.items():
        if isinstance(obj, torch.nn.Module):
            objects[name] = ["module", stable.walk(dict(obj.state_dict()), name)]
        elif isinstance(obj, torch.optim.Optimizer):
            walker = _Flattener(live=None)  # all of it changes only in step()
            objects[name] = ["optimizer", walker.walk(_optimizer_state(obj, fqns), name)]
            stable.tensors.extend(walker.tensors)
        elif isinstance(obj, torch.Tensor):
            objects[name] = ["tensor", stable.walk(obj, name)]
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            objects[name] = ["stateful", stable.walk(obj.state_dict(), name)]
        else:
            raise StateMismatch(
                f"ctx.track({name}=…) got a {type(obj).__name__}, which has no state_dict() and "
                "load_state_dict(); track modules, optimizers, tensors or Stateful objects"
            )
    meta = {"step": step, "rng": capture_rng(), "objects": objects, **extra}
    blob = msgpack.packb(meta, use_bin_type=True)
    return Captured(stable.tensors, blob)


def layout(
    tensors: Iterable[tuple[str, torch.Tensor]], blob_nbytes: int
) -> tuple[list[ChunkRecord], int]:
    """Byte layout of a slot: aligned tensor chunks, then the blob. Returns (chunks, used)."""
    chunks = []
    offset = 0
    for key, tensor in tensors:
        shape = tuple(tensor.shape)
        nbytes = tensor.numel() * tensor.element_size()
        chunks.append(
            ChunkRecord(
                key, dtype_name(tensor.dtype), shape, (0,) * len(shape), shape, offset, nbytes
            )
        )
        offset = align(offset + nbytes)
    chunks.append(
        ChunkRecord(META_KEY, "uint8", (blob_nbytes,), (0,), (blob_nbytes,), offset, blob_nbytes)
    )
    return chunks, offset + blob_nbytes


def write_slot(slot: torch.Tensor, chunks: list[ChunkRecord], captured: Captured) -> None:
    """Copy captured tensors and the blob into ``slot`` at the offsets of ``chunks``."""
    for chunk, (_, tensor) in zip(chunks, captured.tensors, strict=False):
        if chunk.nbytes:
            chunk_view(slot, chunk).copy_(tensor)
    meta = chunks[-1]
    blob = torch.frombuffer(bytearray(captured.blob), dtype=torch.uint8)
    slot[meta.byte_offset : meta.byte_offset + meta.nbytes].copy_(blob)


def chunk_view(slot: torch.Tensor, chunk: ChunkRecord) -> torch.Tensor:
    """The slot's bytes of ``chunk`` as a tensor of its dtype and shape (no copy)."""
    raw = slot[chunk.byte_offset : chunk.byte_offset + chunk.nbytes]
    return raw.view(dtype_of(chunk.dtype)).view(chunk.lengths)


def read_meta(slot: torch.Tensor, chunks: list[ChunkRecord]) -> dict[str, Any]:
    """Decode the blob of a slot (tensor references stay as their keys)."""
    meta_chunk = next(c for c in chunks if c.key == META_KEY)
    raw = (
        slot[meta_chunk.byte_offset : meta_chunk.byte_offset + meta_chunk.nbytes].numpy().tobytes()
    )
    meta: dict[str, Any] = msgpack.unpackb(
        raw, ext_hook=_ext_hook(None), raw=False, strict_map_key=False
    )
    return meta


def restore(
    tracked: dict[str, Any],
    slot: torch.Tensor,
    chunks: list[ChunkRecord],
    all_tracked: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load the snapshot in ``slot`` into the tracked objects; return the decoded blob.

    Only the objects named in ``tracked`` are loaded; ``all_tracked`` (every object tracked
    in this epoch so far) supplies parameter names for optimizers. RNG states are left to the
    caller.
    """
    views = {c.key: chunk_view(slot, c) for c in chunks if c.key != META_KEY}
    meta_chunk = next(c for c in chunks if c.key == META_KEY)
    raw = (
        slot[meta_chunk.byte_offset : meta_chunk.byte_offset + meta_chunk.nbytes].numpy().tobytes()
    )
    meta: dict[str, Any] = msgpack.unpackb(
        raw, ext_hook=_ext_hook(views), raw=False, strict_map_key=False
    )
    objects = meta["objects"]
    missing = sorted(set(tracked) - set(objects))
    if missing:
        raise StateMismatch(
            f"ctx.track got {missing}, which the snapshot of step {meta['step']} does not have "
            f"(it has {sorted(objects)}); track the same names in every epoch"
        )
    fqns = param_fqns(all_tracked if all_tracked is not None else tracked)
    for name, obj in tracked.items():
        kind, tree = objects[name]
        if kind == "module":
            try:
                obj.load_state_dict(tree, strict=True)
            except RuntimeError as exc:
                raise StateMismatch(
                    f"tracked module {name!r} does not match the snapshot of step "
                    f"{meta['step']}; build it the same way in every epoch. {exc}"
                ) from exc
        elif kind == "optimizer":
            _load_optimizer(obj, tree, fqns)
        elif kind == "tensor":
            if obj.shape != tree.shape or obj.dtype != tree.dtype:
                raise StateMismatch(
                    f"tracked tensor {name!r} is {tuple(obj.shape)} {obj.dtype}, the snapshot has "
                    f"{tuple(tree.shape)} {tree.dtype}"
                )
            with torch.no_grad():
                obj.copy_(tree)
        else:
            obj.load_state_dict(_clone_tree(tree))
    # RNG states are applied by the caller right before the first resumed step, so that
    # whatever the function does between track() and steps() cannot shift them.
    return meta


def _clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone_tree(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_clone_tree(v) for v in tree)
    return tree
