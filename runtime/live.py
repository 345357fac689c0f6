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
* ``usable`` (the next epoch, restoring step s in the same topology, as the same rank)
  hands them to the restore, which makes the new objects use them (``restore.adopt``) instead
  of copying. Anything else forgets them, so that their memory is free before the new model is
  built.

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
        """The live tensors are about to change (an optimizer step runs)."""
        with self._lock:
            self.step = None
            self._tensors = {}

    def usable(self, rank: int, world_size: int, step: int | None) -> dict[str, torch.Tensor]:
        """The live tensors by chunk key if they hold ``step`` of ``rank`` in a world of
        ``world_size`` (a restore in the same topology); otherwise forget them and return
        nothing. Either way they are kept no longer than the caller holds the result."""
        with self._lock:
            ok = (
                step is not None
                and self.step == step
                and self.rank == rank
                and self.world_size == world_size
            )
            tensors = self._tensors if ok else {}
            if not ok:
                self.step, self._tensors = None, {}
            return dict(tensors)

    def keep_for(self, rank: int, world_size: int, step: int | None) -> None:
        """A new epoch begins: keep the references only if its restore can use them (step
        ``step`` of ``rank`` in a world of ``world_size``; None: it restores nothing in the
        same topology), so that the memory of the old objects is free before new ones are
        built."""
        self.usable(rank, world_size, step)

    def forget(self) -> None:
        """Drop the references (their memory goes with the old objects)."""
        self.dirty()


def _whole(t: torch.Tensor) -> bool:
    """``t`` is the whole of its storage, front to back (not a view into a larger buffer, as
    FSDP2's padded shards are: those are copied into, never re-pointed)."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def adopt(owner: Any, live: torch.Tensor) -> bool:
    """Make ``owner`` (a parameter or buffer object, or a DTensor parameter's local shard) use
    ``live``'s memory instead of its own, without copying; False (nothing changed) where that
    is not safe: another shape, dtype, device or layout, or either is a view into a larger
    buffer. The caller copies then, as before."""
    dst: Any = owner
    if is_dtensor(owner):
        dst = owner._local_tensor  # the shard itself (to_local() is another tensor object)
    if (
        not isinstance(dst, torch.Tensor)
        or dst.shape != live.shape
        or dst.dtype != live.dtype
        or dst.device != live.device
        or not _whole(dst)
        or not _whole(live)
    ):
        return False
    if dst.data_ptr() != live.data_ptr():
        with torch.no_grad():
            dst.set_(live.untyped_storage(), 0, live.shape, live.stride())
    return True


def owners(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameter and buffer objects of ``module`` by state_dict name (tied ones under each
    of their names)."""
    found: dict[str, torch.Tensor] = dict(module.named_buffers(remove_duplicate=False))
    found.update(module.named_parameters(remove_duplicate=False))
    return found
