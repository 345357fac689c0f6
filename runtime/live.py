"""What the rank's live tensors hold, so that a survivor restores without copying.

After a failure every surviving rank calls the training function again and builds its model
anew; restoring the committed step into those new objects means copying the whole state back
out of its slot, into memory nothing has touched yet. Yet a survivor usually notices the
failure inside a backward-pass collective, before its optimizer step: its old tensors still
hold exactly the step its last snapshot captured. ``LiveState`` knows when that is so, by the
runtime's own step counter, never by comparing bytes:

* ``captured`` (end of step s, when the snapshot of s is taken) records references to the
  captured tensors that are the live ones (optimizer state, the parameters a tracked
  optimizer updates, frozen parameters — those ``capture`` does not clone) and that they hold
  step s;
* ``dirty`` (the optimizer step pre-hook, once the step is going to run) says they no longer
  do — an optimizer step that starts may stop half way;
* ``usable`` (the next epoch, restoring in the same topology as the same rank) hands them to
  the restore. If they hold the restored step, the new objects use them (``adopt``) and no
  byte is copied; if not (an optimizer step ran since), the restore copies the slot into them
  — memory that is already touched, where the new objects' is not — and the new objects use
  them all the same. A restore into another topology, or none, forgets them, so that their
  memory is free before new objects are built.

The price: a survivor holds its old tensors while the function builds its new objects (until
``ctx.track``), twice the state for that moment.

This module owns that bookkeeping only; it never copies, and never decides what is restored.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from peerckpt.runtime.capture import Captured
from peerckpt.runtime.layouts import is_dtensor


class LiveState:
    """References to the rank's live tensors and the step they hold (None: unknown)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step: int | None = None
        self.rank = -1
        self.world_size = -1
        self._tensors: dict[str, torch.Tensor] = {}

    def captured(self, rank: int, world_size: int, step: int, captured: Captured) -> None:
        """The snapshot of ``step`` was taken from these tensors: the live ones hold it."""
        with self._lock:
            self.step, self.rank, self.world_size = step, rank, world_size
            self._tensors = {t.key: t.tensor for t in captured.tensors if t.live}

    def dirty(self) -> None:
        """The live tensors are about to change (an optimizer step runs); they are still the
        live ones, holding no known step."""
        with self._lock:
            self.step = None

    def usable(
        self, rank: int, world_size: int, step: int | None
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """The live tensors by chunk key, and whether they hold ``step``, for a restore of
        ``rank`` in a world of ``world_size`` in the same topology (``step`` None: none);
        for anything else, nothing: they are forgotten."""
        with self._lock:
            if step is None or self.rank != rank or self.world_size != world_size:
                self.step, self._tensors = None, {}
            return dict(self._tensors), step is not None and self.step == step

    def keep_for(self, rank: int, world_size: int, step: int | None) -> None:
        """A new epoch begins: keep the references only if its restore can use them (step
        ``step`` of ``rank`` in a world of ``world_size``; None: it restores nothing in the
        same topology), so that the memory of the old objects is free before new ones are
        built."""
        self.usable(rank, world_size, step)

    def forget(self) -> None:
        """Drop the references (their memory goes with the old objects)."""
        with self._lock:
            self.step, self._tensors = None, {}


def _whole(t: torch.Tensor) -> bool:
    """``t`` is the whole of its storage, front to back (not a view into a larger buffer, as
    FSDP2's padded shards are: those are copied into, never re-pointed)."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _target(owner: Any) -> Any:
    # a DTensor's shard itself (its to_local() is another tensor object)
    return owner._local_tensor if is_dtensor(owner) else owner


def adoptable(owner: Any, live: torch.Tensor | None) -> bool:
    """Whether ``owner`` (a parameter or buffer object, or a DTensor parameter) can use
    ``live``'s memory instead of its own: not with another shape, dtype, device or layout,
    nor where either is a view into a larger buffer."""
    dst = _target(owner)
    return (
        live is not None
        and isinstance(dst, torch.Tensor)
        and dst.shape == live.shape
        and dst.dtype == live.dtype
        and dst.device == live.device
        and _whole(dst)
        and _whole(live)
    )


def adopt(owner: Any, live: torch.Tensor) -> bool:
    """Make ``owner`` use ``live``'s memory instead of its own, without copying; False
    (nothing changed) where that is not safe (``adoptable``): the caller copies then."""
    if not adoptable(owner, live):
        return False
    dst = _target(owner)
    if dst.data_ptr() != live.data_ptr():
        # ``.data =``, never ``set_``: ``set_`` gives a leaf parameter a new gradient
        # accumulator, and the hooks on the old one — DDP's reducer's, which all-reduce the
        # gradients — never fire again. A survivor restored from a snapshot without DDP's
        # rebuilt buckets (the step-0 snapshot: nothing re-creates its reducer) then trained
        # alone, silently, and its spare waited in the all-reduce forever (measured, torch
        # 2.13: ``set_`` → a new AccumulateGrad node, hooks silent; ``.data =`` → the same).
        dst.data = live
    return True


def owners(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameter and buffer objects of ``module`` by state_dict name (tied ones under each
    of their names)."""
    found: dict[str, torch.Tensor] = dict(module.named_buffers(remove_duplicate=False))
    found.update(module.named_parameters(remove_duplicate=False))
    return found
