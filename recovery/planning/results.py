"""A recovery plan's result: every new rank's reads, kept as the planner made them.

The table's reads stay arrays of shared pieces (``recovery/planning/table_reads.py``); those planned chunk
by chunk stay :class:`Read` lists. A rank's reads are made on demand, in wanted order, as a
read-only sequence; ``recovery/planning/message.py`` sends them as arrays instead. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from peerckpt.boxes import Box
from peerckpt.reads import Read, new_read
from peerckpt.recovery.planning.table_reads import TableReads
from peerckpt.recovery.planning.tables import ChunkTable


class ReadPlan:
    """Every new rank's reads: the table's as arrays (``table``, ``rows``), the others as
    :class:`Read` lists. ``reads(rank)`` makes a rank's reads on demand, in wanted order;
    ``recovery/planning/message.py`` sends them as arrays."""

    def __init__(
        self,
        order: list[int],
        table: ChunkTable | None,
        rows: TableReads | None,
        places: np.ndarray,
        rest: list[list[Read]],
        rest_positions: list[list[int]],
    ) -> None:
        self.order = order
        self.table = table
        self.rows = rows
        self.rest = rest
        self.rest_positions = rest_positions  # of each rest read's chunk in its rank's list
        self.place_of = {new: place for place, new in enumerate(order)}
        self.row_of: dict[int, int] = {int(p): row for row, p in enumerate(places.tolist())}

    def reads(self, new: int) -> Sequence[Read]:
        """New rank ``new``'s reads, in wanted order (a sequence made on demand)."""
        return _RankReads(self, self.place_of[new])

    def by_rank(self) -> dict[int, Sequence[Read]]:
        """Every new rank's reads (sequences made on demand)."""
        return {new: _RankReads(self, place) for place, new in enumerate(self.order)}

    def rank_reads(self, place: int) -> Iterator[Read]:
        """The reads of the rank at ``place``, in wanted order."""
        rest, positions = self.rest[place], self.rest_positions[place]
        row = self.row_of.get(place)
        if row is None or self.rows is None or self.table is None:
            yield from rest
            return
        rows, table = self.rows, self.table
        pieces = []  # per group: the row's pieces as (node, rank, held box, region, elements)
        for group in rows.groups:
            lo, hi = int(group.ptr[row]), int(group.ptr[row + 1])
            n = group.ndim
            pieces.append(
                [
                    (
                        node,
                        rank,
                        Box(tuple(s[:n]), tuple(s[n:])),
                        Box(tuple(r[:n]), tuple(r[n:])),
                        e,
                    )
                    for node, rank, s, r, e in zip(
                        group.node[lo:hi].tolist(),
                        group.rank[lo:hi].tolist(),
                        group.src[lo:hi].tolist(),
                        group.region[lo:hi].tolist(),
                        group.elements[lo:hi].tolist(),
                        strict=True,
                    )
                ]
            )
        i = 0  # the next of the reads planned chunk by chunk
        for j, (g, size, key) in enumerate(
            zip(rows.group_of_column.tolist(), rows.sizes.tolist(), table.keys, strict=True)
        ):
            if g < 0:
                while i < len(rest) and positions[i] == j:
                    yield rest[i]
                    i += 1
                continue
            if not pieces[g]:
                continue
            dst = table.box(row, j)
            for node, rank, src, region, elements in pieces[g]:
                yield new_read((node, rank, key, src, dst, region, elements * size))
        yield from rest[i:]


class _RankReads(Sequence[Read]):
    """One new rank's reads, in wanted order, made on demand from the plan's arrays."""

    __slots__ = ("_list", "_place", "_plan")

    def __init__(self, plan: ReadPlan, place: int) -> None:
        self._plan = plan
        self._place = place
        self._list: list[Read] | None = plan.rest[place] if place not in plan.row_of else None

    def __iter__(self) -> Iterator[Read]:
        return iter(self._list) if self._list is not None else self._make()

    def _make(self) -> Iterator[Read]:
        return self._plan.rank_reads(self._place)

    def _reads(self) -> list[Read]:
        if self._list is None:
            self._list = list(self._make())
        return self._list

    def __len__(self) -> int:
        if self._list is not None:
            return len(self._list)
        plan, row = self._plan, self._plan.row_of[self._place]
        assert plan.rows is not None
        return plan.rows.reads_of_row(row) + len(plan.rest[self._place])

    @overload
    def __getitem__(self, index: int) -> Read: ...

    @overload
    def __getitem__(self, index: slice) -> list[Read]: ...

    def __getitem__(self, index: int | slice) -> Read | list[Read]:
        return self._reads()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _RankReads):
            return self._reads() == other._reads()
        if isinstance(other, list):
            return self._reads() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RankReads({self._reads()!r})"
