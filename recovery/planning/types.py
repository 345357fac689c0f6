"""The planner's input words: held and wanted chunks (its output, ``Read``, is ground
vocabulary in ``peerckpt/reads.py``, since the agents carry reads out).

``HeldChunk`` and ``WantedChunk`` have the same fields on purpose and stay two types: the
planner's tables (``tables.py``) are built from either side, and the type is what tells a
held box (a source: checked inside its tensor, disjoint, renamed per old rank when private)
from a wanted one (a destination: covered exactly by pieces of held ones). One type with a
role flag would move that check from the type to every call site.
"""

from __future__ import annotations

from dataclasses import dataclass

from peerckpt.boxes import Box


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
