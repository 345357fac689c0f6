"""Snapshot objects into an in-memory slot and restore them from it, as a rank does in the
same topology, without an agent: shared by the capture and restore tests."""

from __future__ import annotations

import torch

from peerckpt.runtime import capture, restore


def snapshot(objs: dict, step: int) -> tuple[torch.Tensor, list]:
    """Capture ``objs`` at ``step`` into a fresh slot; return the slot and its chunks."""
    captured = capture.capture(objs, step, {})
    chunks, used = capture.layout(captured.tensors, len(captured.blob))
    slot = torch.zeros(used, dtype=torch.uint8)
    capture.write_slot(slot, chunks, captured)
    return slot, chunks


def restore_from_slot(objs: dict, slot: torch.Tensor, chunks: list) -> dict:
    """Restore ``objs`` from the slot as a rank does in the same topology; return its meta."""
    meta = restore.read_meta(slot, chunks[-1])
    source = restore.ChunkSource(chunks, slot=slot)
    restore.restore_objects(objs, objs, source, {0: meta}, 0, 0, 1, resharded=False)
    return meta
