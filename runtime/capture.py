"""State capture: tracked objects → tensor chunks plus one msgpack blob.

``capture`` walks what the user passed to ``ctx.track``: modules (their state_dict),
optimizers (state keyed by parameter FQN, never by index), plain tensors and
``peerckpt.Shard``s, anything with ``state_dict()/load_state_dict()``, plus the RNG states the
runtime tracks on its own. Every tensor becomes a chunk — its local data and its box in the
global tensor (``layouts.place``) — copied into the slot in the background; everything else
goes into a *skeleton* of dicts, lists and scalars in which each tensor is replaced by a
reference to its chunk (msgpack extension types). ``runtime/restore.py`` does the inverse.
Nothing is pickled.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from peerckpt.codec import NDARRAY_EXT, TENSOR_EXT, TUPLE_EXT, Ext, pack
from peerckpt.dtypes import dtype_name
from peerckpt.errors import StateMismatch
from peerckpt.manifest import META_KEY, ChunkRecord, align
from peerckpt.runtime.carried import CARRIED
from peerckpt.runtime.layouts import FlatShard, Shard, chunk_view, is_dtensor, local_of, place

try:
    import numpy as np
except ImportError:  # numpy is optional for the training process
    np = None  # type: ignore[assignment]

_SCALARS = (type(None), bool, int, float, str, bytes)


@dataclass(frozen=True)
class CapturedTensor:
    """One chunk to copy: this rank's data of ``key`` and where it sits globally."""

    key: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    scope: str  # "global" or "rank"
    live: bool = False  # the tensor itself (copied later), not a clone made at capture


@dataclass
class Captured:
    """One snapshot's worth of state: tensors to copy and the encoded blob."""

    tensors: list[CapturedTensor]
    blob: bytes
    # Keys every data-parallel rank holds equal (``runtime/twins.py``), declared to the agent.
    twins: frozenset[str] = frozenset()


class _Flattener:
    """Replaces tensors by chunk references. A tensor is kept by reference (copied later, in
    the background) only if its data pointer is in ``live``; any other is cloned now."""

    def __init__(self, live: set[int] | None, scope: str = "global") -> None:
        self.live = live
        self.scope = scope
        self.tensors: list[CapturedTensor] = []

    def walk(self, obj: Any, path: str) -> Any:
        if isinstance(obj, (torch.Tensor, Shard)):
            placed = place(obj)
            tensor = placed.local
            live = self.live is None or tensor.data_ptr() in self.live
            if not live:
                tensor = tensor.clone()
            # A DTensor or Shard is a box of a global tensor wherever it is found: in a
            # Stateful's state_dict too (DCP's get_state_dict of an FSDP2 model), so that it
            # is restored, and resharded, as a DTensor (``restore.py``).
            scope = "global" if is_dtensor(obj) or isinstance(obj, Shard) else self.scope
            self.tensors.append(
                CapturedTensor(path, tensor, placed.global_shape, placed.offsets, scope, live)
            )
            return Ext(TENSOR_EXT, path.encode())
        if isinstance(obj, dict):
            return {k: self.walk(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self.walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return Ext(TUPLE_EXT, pack(items))
        if np is not None and isinstance(obj, np.ndarray):
            meta = [obj.dtype.str, list(obj.shape), obj.tobytes()]
            return Ext(NDARRAY_EXT, pack(meta))
        if np is not None and isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, _SCALARS):
            return obj
        raise StateMismatch(
            f"cannot snapshot a {type(obj).__name__} at {path!r}: tracked state may hold "
            "tensors, numbers, strings, bytes, lists, tuples and dicts; convert it in state_dict()"
        )


def _plain(value: Any, room: list[int] | None = None) -> bool:
    """Tensors (no DTensor), numbers, strings and lists, tuples and dicts of them, 64 leaves
    at most: what a carried value may be to be saved."""
    room = room if room is not None else [64]
    room[0] -= 1
    if room[0] < 0 or is_dtensor(value):
        return False
    if isinstance(value, (torch.Tensor, *_SCALARS)):
        return True
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, room) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v, room) for v in value)
    return False


def boxes(obj: Any, path: str) -> dict[str, torch.Tensor | Shard]:
    """The DTensors and Shards of a state_dict by the chunk key ``_Flattener.walk`` gives them
    (the same path scheme)."""
    if is_dtensor(obj) or isinstance(obj, Shard):
        return {path: obj}
    out: dict[str, torch.Tensor | Shard] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(boxes(v, f"{path}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(boxes(v, f"{path}/{i}"))
    return out


def param_fqns(tracked: dict[str, Any]) -> dict[int, str]:
    """id(parameter) → "<tracked name>.<fqn>" for every tracked module."""
    names: dict[int, str] = {}
    for name, obj in tracked.items():
        if isinstance(obj, torch.nn.Module):
            for fqn, param in obj.named_parameters():
                names.setdefault(id(param), f"{name}.{fqn}")
    return names


def optimizer_state(optim: torch.optim.Optimizer, fqns: dict[int, str]) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter FQN instead of index."""
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
    else:
        # CUDA not started yet: a fresh process's CUDA generators would be seeded with this,
        # at their lazy start (``torch.manual_seed`` queues it for every device)
        rng["cuda_seed"] = torch.initial_seed()
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
    if "cuda_seed" in rng and "cuda" not in rng and torch.cuda.is_available():
        torch.cuda.manual_seed_all(int(rng["cuda_seed"]))  # as a fresh process's first use
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
            pointers.update(local_of(p).data_ptr() for g in obj.param_groups for p in g["params"])
        elif isinstance(obj, torch.nn.Module):
            pointers.update(local_of(p).data_ptr() for p in obj.parameters() if not p.requires_grad)
    return pointers


def sampler_epoch(loader: Any) -> int | None:
    """The epoch of a tracked loader's sampler where that sampler keeps no state of its own
    (``DistributedSampler``: what ``set_epoch`` set, which orders its shuffle); None for
    anything else. torchdata's StatefulDataLoader saves how far the sampler's iterator got,
    and after a restore makes a new one and skips as far: in the order of the sampler's epoch
    as the code before the loop left it (0), not as the loop had set it. Measured: a
    DistributedSampler job whose loop calls ``set_epoch`` at each data epoch's first step
    differed from the step after a restore in the second data epoch on, with nothing said."""
    if not (callable(getattr(loader, "load_state_dict", None)) and hasattr(loader, "sampler")):
        return None
    sampler = loader.sampler
    epoch = getattr(sampler, "epoch", None)
    if hasattr(sampler, "state_dict") or type(epoch) is not int:
        return None
    return epoch


def capture(
    tracked: dict[str, Any],
    step: int,
    extra: dict[str, Any],
    carried: dict[str, Any] | None = None,
) -> Captured:
    """Capture every tracked object.

    Optimizer state and the parameters it updates are referenced, not copied: the copy into
    the slot runs in the background and ``optimizer.step()`` waits for it. Every other tensor
    (buffers, parameters no tracked optimizer owns, plain tensors, Stateful state) may change
    anywhere in the next iteration, so it is cloned here. Tensors of Stateful objects are the
    rank's private state (scope "rank"), except DTensors and Shards; all others are boxes of
    shared tensors. ``carried``: what the loop carries into the next step in its variables
    (``runtime/carried.py``), saved as private state where it is tensors, numbers, strings
    and containers of them.
    """
    shared = _Flattener(live=_stable_pointers(tracked))
    private = _Flattener(live=set(), scope="rank")
    fqns = param_fqns(tracked)
    objects: dict[str, Any] = {}
    for name, obj in tracked.items():
        if isinstance(obj, torch.nn.Module):
            objects[name] = ["module", shared.walk(dict(obj.state_dict()), name)]
        elif isinstance(obj, torch.optim.Optimizer):
            walker = _Flattener(live=None)  # all of it changes only in step()
            objects[name] = ["optimizer", walker.walk(optimizer_state(obj, fqns), name)]
            shared.tensors.extend(walker.tensors)
        elif isinstance(obj, (torch.Tensor, Shard)):
            objects[name] = ["tensor", shared.walk(obj, name)]
        elif isinstance(obj, FlatShard):
            pieces = []
            for tensor, shape, offsets, lengths, at in obj.pieces():
                key = f"{name}/{tensor}"
                shared.tensors.append(
                    CapturedTensor(key, obj.view(at, lengths).clone(), shape, offsets, "global")
                )
                pieces.append([key, list(offsets), list(lengths)])
            objects[name] = ["flat", pieces]
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            objects[name] = ["stateful", private.walk(obj.state_dict(), name)]
        else:
            raise StateMismatch(
                f"ctx.track({name}=…) got a {type(obj).__name__}, which has no state_dict() and "
                "load_state_dict(); track modules, optimizers, tensors or Stateful objects"
            )
    meta = {"step": step, "rng": capture_rng(), "objects": objects, **extra}
    epochs = {n: e for n, obj in tracked.items() if (e := sampler_epoch(obj)) is not None}
    if epochs:
        meta["sampler_epochs"] = epochs
    saved = {n: v for n, v in (carried or {}).items() if _plain(v)}
    if saved:
        meta["carried"] = private.walk(saved, CARRIED)
    blob = pack(meta)
    boxes = [t for t in private.tensors if t.scope == "global"]  # a slot's shared chunks lead
    return Captured(
        shared.tensors + boxes + [t for t in private.tensors if t.scope != "global"], blob
    )


def layout(tensors: list[CapturedTensor], blob_nbytes: int) -> tuple[list[ChunkRecord], int]:
    """Byte layout of a slot: aligned tensor chunks, then the blob. Returns (chunks, used)."""
    chunks = []
    offset = 0
    for t in tensors:
        nbytes = t.tensor.numel() * t.tensor.element_size()
        chunks.append(
            ChunkRecord(
                t.key,
                dtype_name(t.tensor.dtype),
                t.global_shape,
                t.offsets,
                tuple(t.tensor.shape),
                offset,
                nbytes,
                scope=t.scope,
            )
        )
        offset = align(offset + nbytes)
    meta = ChunkRecord(
        META_KEY, "uint8", (blob_nbytes,), (0,), (blob_nbytes,), offset, blob_nbytes, scope="rank"
    )
    return [*chunks, meta], offset + blob_nbytes


def write_slot(
    slot: torch.Tensor,
    chunks: list[ChunkRecord],
    captured: Captured,
    non_blocking: bool = False,
    midway: Callable[[], object] | None = None,
) -> None:
    """Copy captured tensors and the blob into ``slot`` at the offsets of ``chunks``.

    ``non_blocking``: device tensors are copied asynchronously on the current streams (the
    caller waits for them); host tensors are always copied at once. ``midway`` is called
    once half of the tensors are copied (the chaos harness strikes there)."""
    half = len(captured.tensors) // 2
    for i, (chunk, t) in enumerate(zip(chunks, captured.tensors, strict=False)):
        if i == half and midway is not None:
            midway()
        if chunk.nbytes:
            chunk_view(slot, chunk).copy_(t.tensor, non_blocking=non_blocking)
    meta = chunks[-1]
    blob = torch.frombuffer(bytearray(captured.blob), dtype=torch.uint8)
    slot[meta.byte_offset : meta.byte_offset + meta.nbytes].copy_(blob)
