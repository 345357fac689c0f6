"""State restore: chunks and skeletons of a committed step → the tracked objects of a new epoch.

Two sources feed it. In the same topology, a rank's own snapshot slot: its skeleton and
chunks are exactly what it captured. After a topology change, a *staging* slot that the
agent assembled for the rank's new layout: for every box the rank wants (``wanted_chunks``),
the bytes of the committed step, gathered from whichever old ranks held them; plus every old
rank's blob (``__meta__@<old rank>``) and private state (``<key>@<old rank>``).

Module tensors are copied in place into the new objects' state_dict tensors (DTensor shards
included); optimizer state is rebuilt keyed by parameter name (as DTensors where the parameter
is one); Stateful objects get their state back with ``load_state_dict`` — or, after a topology
change, every old rank's state through ``load_resharded_state`` if they implement it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from peerckpt.codec import NDARRAY_EXT, TENSOR_EXT, TUPLE_EXT, unpack
from peerckpt.dtypes import dtype_name, dtype_of
from peerckpt.errors import StateMismatch
from peerckpt.manifest import META_KEY, ChunkRecord
from peerckpt.runtime import live
from peerckpt.runtime.capture import boxes, param_fqns, sampler_epoch
from peerckpt.runtime.layouts import (
    FlatShard,
    Shard,
    chunk_view,
    is_dtensor,
    local_of,
    place,
)

try:
    import numpy as np
except ImportError:
    np = None  # type: ignore[assignment]

try:
    from torch.distributed.tensor import DTensor
except ImportError:
    DTensor = None  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class TensorRef:
    """A skeleton's reference to a chunk, resolved against a ``ChunkSource``."""

    key: str


def private_key(key: str, old_rank: int) -> str:
    """The name under which a restoring rank sees old rank ``old_rank``'s private chunk."""
    return f"{key}@{old_rank}"


def _ext_hook(code: int, data: bytes) -> Any:
    if code == TENSOR_EXT:
        return TensorRef(data.decode())
    if code == TUPLE_EXT:
        return tuple(unpack(data, _ext_hook))
    if code == NDARRAY_EXT and np is not None:
        dtype, shape, raw = unpack(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    raise StateMismatch(f"unknown msgpack extension {code} in a snapshot")


def decode_meta(raw: bytes) -> dict[str, Any]:
    """Decode a snapshot blob; tensors come back as ``TensorRef``."""
    meta: dict[str, Any] = unpack(raw, _ext_hook)
    return meta


def read_meta(slot: torch.Tensor, chunk: ChunkRecord) -> dict[str, Any]:
    return decode_meta(slot[chunk.byte_offset : chunk.byte_offset + chunk.nbytes].numpy().tobytes())


class ChunkSource:
    """The restored chunks of one slot, by key (and box, where a key has several).

    Backed either by the slot's mapping (a uint8 tensor: the rank's own slots, mapped once
    and reused) or by an open file of the slot (``fd``: a staging segment, read once). From a
    file, chunks are read with ``preadv`` straight into their destination: the bytes are
    copied once, and the rank never maps (and page-faults) a segment it reads only once.
    Either way what this hands out never aliases the slot.
    """

    def __init__(
        self, chunks: list[ChunkRecord], slot: torch.Tensor | None = None, fd: int | None = None
    ) -> None:
        if (slot is None) == (fd is None):
            raise ValueError("a ChunkSource reads either a mapped slot or a file, not both")
        self.slot = slot
        self.fd = fd
        self.records = {c.key: c for c in chunks}
        self.boxes = {(c.key, tuple(c.offsets)): c for c in chunks}

    def record(
        self, key: str, old_rank: int, offsets: tuple[int, ...] | None = None
    ) -> ChunkRecord:
        """Old rank ``old_rank``'s chunk ``key``: its private copy if there is one, else the
        (resharded) box of the shared tensor — the one at ``offsets``, when given."""
        if offsets is not None:
            record = self.boxes.get((key, tuple(offsets)))
        else:
            record = self.records.get(private_key(key, old_rank)) or self.records.get(key)
        if record is None:
            where = f" at {tuple(offsets)}" if offsets is not None else ""
            raise StateMismatch(f"the restored state has no chunk {key!r}{where}")
        return record

    def read(
        self, key: str, old_rank: int, offsets: tuple[int, ...] | None = None
    ) -> tuple[torch.Tensor, ChunkRecord]:
        """The chunk as a new tensor of its dtype and local shape."""
        record = self.record(key, old_rank, offsets)
        if self.slot is not None:
            return chunk_view(self.slot, record).clone(), record
        out = torch.empty(tuple(record.lengths), dtype=dtype_of(record.dtype))
        self._pread(record, out)
        return out, record

    def copy_into(
        self,
        target: Any,
        key: str,
        old_rank: int,
        what: str,
        offsets: tuple[int, ...] | None = None,
    ) -> None:
        """Copy the chunk into ``target`` (a tensor, DTensor or Shard: its local tensor)."""
        record = self.record(key, old_rank, offsets)
        dst = local_of(target)
        shape, dtype = tuple(record.lengths), dtype_of(record.dtype)
        if tuple(dst.shape) != shape or dst.dtype != dtype:
            raise StateMismatch(
                f"{what} is {tuple(dst.shape)} {dst.dtype} here, the snapshot has "
                f"{shape} {dtype}; build it the same way in every epoch"
            )
        with torch.no_grad():
            if self.slot is not None:
                dst.copy_(chunk_view(self.slot, record))
            elif dst.device.type == "cpu" and dst.is_contiguous():
                self._pread(record, dst)
            else:
                dst.copy_(self.read(key, old_rank, offsets)[0])

    def metas(self) -> dict[int, dict[str, Any]]:
        """Every old rank's blob found in this slot, by old rank (staging slots only)."""
        found = {}
        for key, record in self.records.items():
            if key.startswith(META_KEY + "@"):
                found[int(key.rpartition("@")[2])] = decode_meta(self._bytes(record))
        return found

    def _bytes(self, record: ChunkRecord) -> bytes:
        if self.slot is not None:
            raw = self.slot[record.byte_offset : record.byte_offset + record.nbytes]
            return raw.numpy().tobytes()
        out = torch.empty(record.nbytes, dtype=torch.uint8)
        self._pread(record, out)
        return out.numpy().tobytes()

    def _pread(self, record: ChunkRecord, dst: torch.Tensor) -> None:
        assert self.fd is not None
        view = dst.detach().reshape(-1).view(torch.uint8).numpy().data
        if len(view) != record.nbytes:
            raise StateMismatch(
                f"chunk {record.key!r} holds {record.nbytes} bytes, not {len(view)}"
            )
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], record.byte_offset + done)
            if got <= 0:
                raise StateMismatch(
                    f"the restored state ends inside chunk {record.key!r}; the segment is short"
                )
            done += got


def _resolve(tree: Any, fetch: Callable[[str], torch.Tensor]) -> Any:
    if isinstance(tree, TensorRef):
        return fetch(tree.key)  # a new tensor: never the slot's memory
    if isinstance(tree, dict):
        return {k: _resolve(v, fetch) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_resolve(v, fetch) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_resolve(v, fetch) for v in tree)
    return tree


def carried_values(meta: dict[str, Any], source: ChunkSource, rank: int) -> dict[str, Any]:
    """What the loop carried into the step after the one ``meta`` describes (new tensors)."""
    tree = meta.get("carried")
    if not isinstance(tree, dict):
        return {}
    values: dict[str, Any] = _resolve(tree, lambda key: source.read(key, rank)[0])
    return values


def _stateful(
    name: str, obj: Any, source: ChunkSource, old_rank: int, step: int
) -> Callable[[str], Any]:
    """How a Stateful's chunks come back: its private tensors as they were saved; a DTensor
    (or Shard) as one placed like the one at the same key of the object's ``state_dict()``
    now — DCP's convention: what ``load_state_dict`` gets has the layout of what
    ``state_dict()`` gives, such as torch's ``get_state_dict`` of an FSDP2 model (after a
    topology change the chunk is this rank's box of the new layout)."""
    targets: dict[str, Any] | None = None

    def fetch(key: str) -> Any:
        nonlocal targets
        local, record = source.read(key, old_rank)
        if record.scope != "global":
            return local
        if targets is None:
            targets = boxes(obj.state_dict(), name)
        return _placed_like(targets.get(key), local, record, name, step)

    return fetch


def _placed_like(
    target: Any, local: torch.Tensor, record: ChunkRecord, name: str, step: int
) -> Any:
    if target is not None:
        placed = place(target)
        if (
            placed.global_shape == tuple(record.global_shape)
            and placed.offsets == tuple(record.offsets)
            and placed.local.shape == local.shape
            and placed.local.dtype == local.dtype
        ):
            local = local.to(placed.local.device)
            if isinstance(target, Shard):
                return Shard(local, target.global_shape, target.offsets)
            return _dtensor_like(local, target)
        now = (
            f"a {placed.global_shape} {dtype_name(placed.local.dtype)} one whose box here is "
            f"{tuple(placed.local.shape)} at {placed.offsets}"
        )
    else:
        now = "none"
    key = record.key.partition("/")[2]
    raise StateMismatch(
        f"tracked {name!r}: in the snapshot of step {step} its state_dict() holds a "
        f"{tuple(record.global_shape)} {record.dtype} DTensor at {key!r} (this rank's box "
        f"{tuple(record.lengths)} at {tuple(record.offsets)}); its state_dict() now holds {now}. "
        "A Stateful's DTensors are restored into the layout its state_dict() gives: return the "
        "same keys, placed the same way, in every epoch (torch's get_state_dict does, also "
        "before the optimizer's first step)"
    )


def _object(meta: dict[str, Any], name: str, step: int) -> tuple[str, Any]:
    objects = meta["objects"]
    if name not in objects:
        raise StateMismatch(
            f"ctx.track got {name!r}, which the snapshot of step {step} does not have "
            f"(it has {sorted(objects)}); track the same names in every epoch"
        )
    kind, tree = objects[name]
    return kind, tree


def _wrapping_hint(missing: list[str], unexpected: list[str]) -> str:
    """What a mismatch that is only DDP's ``module.`` prefix means, else nothing."""
    if {f"module.{k}" for k in missing} == set(unexpected):
        was, now = "wrapped in DistributedDataParallel", "is not"
    elif {f"module.{k}" for k in unexpected} == set(missing):
        was, now = "not wrapped in DistributedDataParallel", "is"
    else:
        return ""
    return (
        f" (the snapshot's module was {was}, this one {now}: wrap it, or not, in every "
        "process alike; a script that decides from WORLD_SIZE or RANK finds them set for "
        "the rank each process runs as)"
    )


def _restore_module(
    name: str,
    obj: torch.nn.Module,
    tree: dict[str, Any],
    copy_into: Callable[[Any, str, str], None],
    step: int,
    adopt: Callable[[torch.Tensor | None, str], bool] = lambda owner, key: False,
) -> None:
    target = obj.state_dict()
    objects = live.owners(obj)
    missing, unexpected = sorted(set(target) - set(tree)), sorted(set(tree) - set(target))
    if missing or unexpected:
        raise StateMismatch(
            f"tracked module {name!r} does not match the snapshot of step {step}: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}; build it the same way in every epoch"
            + _wrapping_hint(missing, unexpected)
        )
    extras = {}
    for key, value in target.items():
        if isinstance(tree[key], TensorRef):
            if not adopt(objects.get(key), tree[key].key):
                copy_into(value, tree[key].key, f"{name}.{key}")
        else:
            extras[key] = tree[key]
    if extras:
        obj.load_state_dict(extras, strict=False)


def _restore_optimizer(
    name: str,
    optim: torch.optim.Optimizer,
    tree: dict[str, Any],
    get: Callable[[str], tuple[torch.Tensor, ChunkRecord]],
    all_tracked: dict[str, Any],
) -> None:
    fqns = param_fqns(all_tracked)
    index: dict[str, int] = {}
    params: dict[str, torch.Tensor] = {}
    for group in optim.param_groups:
        for param in group["params"]:
            if id(param) not in fqns:
                raise StateMismatch(
                    f"optimizer {name!r} has a parameter of no tracked module; track the model "
                    "in the same epoch, e.g. ctx.track(model=model, optim=optim)"
                )
            index[fqns[id(param)]] = len(index)
            params[fqns[id(param)]] = param
    missing = [n for g in tree["param_groups"] for n in g["params"] if n not in index]
    if missing or len(tree["param_groups"]) != len(optim.param_groups):
        raise StateMismatch(
            f"optimizer {name!r} does not match the snapshot (unknown parameters "
            f"{missing[:3]}); build the model and optimizer the same way in every epoch"
        )
    state = {}
    for fqn, entries in tree["state"].items():
        param, restored = params[fqn], {}
        for key, value in entries.items():
            if not isinstance(value, TensorRef):
                restored[key] = value
                continue
            # A new tensor (``read`` never aliases the slot): Optimizer.load_state_dict keeps
            # same-dtype tensors as they are, and a slot's memory must never become live state.
            src, record = get(value.key)
            restored[key] = _like_param(src, record, param)
        state[index[fqn]] = restored
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in tree["param_groups"]]
    optim.load_state_dict({"state": state, "param_groups": groups})


def _like_param(local: torch.Tensor, record: ChunkRecord, param: Any) -> Any:
    """Optimizer state shaped like a DTensor parameter is a DTensor placed like it."""
    if not is_dtensor(param) or tuple(record.global_shape) != tuple(param.shape):
        return local
    return _dtensor_like(local, param)


def _dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """``local`` as this rank's shard of a DTensor placed like the DTensor ``like``."""
    assert DTensor is not None
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def restore_objects(
    tracked: dict[str, Any],
    all_tracked: dict[str, Any],
    source: ChunkSource,
    metas: dict[int, dict[str, Any]],
    primary: int,
    rank: int,
    world_size: int,
    resharded: bool,
    alive: dict[str, torch.Tensor] | None = None,
    clean: bool = False,
) -> int:
    """Load the objects of ``tracked`` from ``source``; return how many bytes were taken
    from ``alive`` instead of copied.

    ``metas``: every old rank's decoded blob (only this rank's own, in the same topology);
    ``primary``: the old rank whose copy of replicated non-tensor state (optimizer settings,
    schedulers, RNG) this rank takes — itself when it survived, else ``rank % old world``.
    ``alive``: this process's live tensors by chunk key (``runtime/live.py``): parameters
    and buffers are re-pointed at them and optimizer state is them. ``clean``: they hold the
    restored step, nothing is copied; otherwise the slot is copied into them first (memory
    already touched, where the new objects' is not).
    """
    meta, step = metas[primary], metas[primary]["step"]
    alive = alive or {}
    adopted = [0]

    def held(key: str) -> tuple[torch.Tensor, ChunkRecord] | None:
        tensor, record = alive.get(key), source.record(key, primary)
        if tensor is None or tuple(tensor.shape) != tuple(record.lengths):
            return None
        if tensor.dtype != dtype_of(record.dtype):
            return None
        if clean:
            adopted[0] += record.nbytes
        else:
            source.copy_into(tensor, key, primary, key)
        return tensor, record

    def adopt(owner: torch.Tensor | None, key: str) -> bool:
        if owner is None or not live.adoptable(owner, alive.get(key)):
            return False
        found = held(key)
        return found is not None and live.adopt(owner, found[0])

    def chunk(key: str) -> tuple[torch.Tensor, ChunkRecord]:
        # The live tensor itself, if any: the new optimizer takes it over.
        return held(key) or source.read(key, primary)

    def copy_into(target: Any, key: str, what: str) -> None:
        source.copy_into(target, key, primary, what)

    for name, obj in tracked.items():
        _, tree = _object(meta, name, step)
        if isinstance(obj, torch.nn.Module):
            _restore_module(name, obj, tree, copy_into, step, adopt)
        elif isinstance(obj, torch.optim.Optimizer):
            _restore_optimizer(name, obj, tree, chunk, all_tracked)
        elif isinstance(obj, (torch.Tensor, Shard)):
            copy_into(obj, tree.key, f"tracked tensor {name!r}")
        elif isinstance(obj, FlatShard):
            for piece, _, offsets, lengths, at in obj.pieces():
                source.copy_into(
                    obj.view(at, lengths),
                    f"{name}/{piece}",
                    primary,
                    f"piece {piece}{offsets} of {name!r}",
                    offsets,
                )
        elif resharded and hasattr(obj, "load_resharded_state"):
            states = [
                _resolve(_object(metas[r], name, step)[1], _stateful(name, obj, source, r, step))
                for r in sorted(metas)
            ]
            obj.load_resharded_state(states, rank, world_size)
        else:
            obj.load_state_dict(_resolve(tree, _stateful(name, obj, source, primary, step)))
            epoch = meta.get("sampler_epochs", {}).get(name)
            if epoch is not None and sampler_epoch(obj) is not None:
                obj.sampler.epoch = epoch  # as set_epoch sets it (capture.sampler_epoch)
    return adopted[0]


@dataclass(frozen=True)
class OldLayout:
    """What the committed step holds, as the coordinator describes it to a resharding rank:
    shared tensors (key → dtype, global shape), each old rank's private chunks, blob sizes."""

    shared: dict[str, tuple[str, tuple[int, ...]]]
    private: dict[int, dict[str, tuple[str, tuple[int, ...]]]]
    meta_bytes: dict[int, int]

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> OldLayout:
        def keys(d: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
            return {k: (v[0], tuple(v[1])) for k, v in d.items()}

        return cls(
            keys(msg["shared"]),
            {int(r): keys(d) for r, d in msg["private"].items()},
            {int(r): n for r, n in msg["meta_bytes"].items()},
        )


def _want(
    key: str,
    dtype: str,
    shape: tuple[int, ...],
    offsets: tuple[int, ...] | None = None,
    lengths: tuple[int, ...] | None = None,
    scope: str = "global",
) -> ChunkRecord:
    offsets = offsets if offsets is not None else (0,) * len(shape)
    lengths = lengths if lengths is not None else shape
    return ChunkRecord(key, dtype, shape, offsets, lengths, 0, 0, scope=scope)


def wanted_chunks(
    objs: dict[str, Any], all_tracked: dict[str, Any], old: OldLayout, primary: int
) -> list[ChunkRecord]:
    """The boxes this rank needs to restore ``objs`` into the new topology (byte offsets 0)."""
    wants: list[ChunkRecord] = []

    def shared(key: str, value: torch.Tensor | Shard, what: str) -> None:
        placed = place(value)
        dtype = dtype_name(placed.local.dtype)
        if old.shared.get(key) != (dtype, placed.global_shape):
            held = old.shared.get(key)
            raise StateMismatch(
                f"{what} is a {placed.global_shape} {dtype} tensor here, the committed step has "
                f"{'nothing of that name' if held is None else f'{held[1]} {held[0]}'}"
            )
        wants.append(
            _want(key, dtype, placed.global_shape, placed.offsets, tuple(placed.local.shape))
        )

    fqns = param_fqns(all_tracked)
    for name, obj in objs.items():
        if isinstance(obj, torch.nn.Module):
            for key, value in obj.state_dict().items():
                if isinstance(value, torch.Tensor):
                    shared(f"{name}/{key}", value, f"{name}.{key}")
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for param in group["params"]:
                    prefix = f"{name}/state/{fqns.get(id(param), '?')}/"
                    placed = place(param)
                    for key, (dtype, shape) in old.shared.items():
                        if not key.startswith(prefix):
                            continue
                        if shape == placed.global_shape:  # elementwise state: the param's box
                            wants.append(
                                _want(key, dtype, shape, placed.offsets, tuple(placed.local.shape))
                            )
                        else:  # scalars and the like: whole
                            wants.append(_want(key, dtype, shape))
        elif isinstance(obj, (torch.Tensor, Shard)):
            shared(name, obj, f"tracked tensor {name!r}")
        elif isinstance(obj, FlatShard):
            for piece, shape, offsets, lengths, _ in obj.pieces():
                key = f"{name}/{piece}"
                dtype = dtype_name(obj.local.dtype)
                if old.shared.get(key) != (dtype, shape):
                    raise StateMismatch(
                        f"{name!r} holds a {shape} {dtype} tensor {piece!r}; the committed step "
                        f"has {old.shared.get(key) or 'nothing of that name'}"
                    )
                wants.append(_want(key, dtype, shape, offsets, lengths))
        else:
            saved = {k for k in old.shared if k.startswith(f"{name}/")}  # its DTensors
            if saved:
                now = boxes(obj.state_dict(), name)
                for key in sorted(saved):
                    if key not in now:
                        raise StateMismatch(
                            f"tracked {name!r}: the committed step has a DTensor at "
                            f"{key.partition('/')[2]!r} of its state_dict(), which holds none "
                            "there now; return the same keys from state_dict() in every epoch"
                        )
                    shared(key, now[key], f"{name}: {key.partition('/')[2]!r} of state_dict()")
            ranks = sorted(old.private) if hasattr(obj, "load_resharded_state") else [primary]
            for r in ranks:
                for key, (dtype, shape) in old.private.get(r, {}).items():
                    if key.startswith(f"{name}/"):
                        wants.append(_want(private_key(key, r), dtype, shape, scope="rank"))
    for r, nbytes in sorted(old.meta_bytes.items()):
        wants.append(_want(private_key(META_KEY, r), "uint8", (nbytes,), scope="rank"))
    return wants
