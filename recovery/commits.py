"""The commit tracker. Pure state, no I/O, no threads.

Step ``s`` is *committed* when every rank of the epoch has reported its snapshot of ``s``
replicated to all of its buddies. The tracker also remembers, for each rank, which nodes hold
a complete copy of the last committed step (the holders a recovery plan reads from), and,
for a rank whose buddies hold it without its data-parallel chunks, those nodes and the twins
verified to hold the rest (``recovery/twins.py``).
"""

from __future__ import annotations

from typing import Any

from peerckpt.coding import Coding
from peerckpt.columns import ChunkColumns
from peerckpt.errors import StaleEpoch
from peerckpt.manifest import META_KEY
from peerckpt.recovery.erasure import mark_rebuildable
from peerckpt.recovery.planning.tables import ChunkLists, ChunkTable, LayoutTable, from_columns
from peerckpt.recovery.planning.types import HeldChunk
from peerckpt.recovery.twins import Report, complete_nodes, partial_nodes, verify


def _with_meta_size(layout: Any, nbytes: int | None) -> Any:
    """A layout (chunk records as msgpack lists, or ``ChunkColumns``) with its blob chunk
    resized to ``nbytes``."""
    if nbytes is None:
        return layout
    if isinstance(layout, ChunkColumns):  # the blob is in its few ``rest`` records
        return layout.with_meta_size(nbytes)
    out = []
    for c in layout:
        if c[0] == META_KEY:
            c = [c[0], c[1], [nbytes], c[3], [nbytes], c[5], nbytes, None, *c[8:]]
        out.append(c)
    return out


class CommitTracker:
    """Counts replicated snapshots per step and commits a step once every rank has it.

    It also keeps what a recovery needs about the committed step: which nodes hold each
    rank's copy, each rank's chunk layout, and the layout generation it belongs to.

    A report costs O(1) however many ranks the epoch has, and so does a commit: the
    committed layouts (each rank's, its blob resized to that step's) are made only when a
    recovery or a flush reads them (``committed_layouts``).
    """

    def __init__(
        self,
        epoch: int,
        ranks: frozenset[int],
        gen: int = 0,
        committed_step: int | None = None,
        committed_gen: int = 0,
        committed_holders: dict[int, set[int]] | None = None,
        committed_layouts: dict[int, list[Any]] | None = None,
        committed_table: ChunkTable | None = None,
    ) -> None:
        self.epoch = epoch
        self.ranks = ranks
        self.gen = gen
        self.committed_step = committed_step
        self.committed_gen = committed_gen
        self.committed_holders: dict[int, set[int]] = committed_holders or {}
        self._committed_layouts: dict[int, list[Any]] | None = committed_layouts or {}
        # The committed step's layouts, before they are made: each rank's, its blob's size.
        self._committed_base: dict[int, list[Any]] = {}
        self._committed_sizes: dict[int, int] = {}
        self._pending: dict[int, dict[int, set[int]]] = {}
        self._layouts: dict[int, list[Any]] = {}
        self._layouts_shared = False  # ``_layouts`` is also the committed step's: copy on write
        # The planner's held table of ``_layouts``, filled as they arrive (columns only), and
        # the committed step's (``held_lists``): a recovery never builds it.
        self._table = LayoutTable(ranks)
        self.committed_table = committed_table
        self._all_layouts = False  # every rank's layout is known (they are never removed)
        self._meta: dict[int, dict[int, int]] = {}  # step → rank → blob size
        self.last_replicated: dict[int, int] = {}
        # Redundancy-aware replication (``recovery/twins.py``): each report's twin facts per
        # step; rank → its node and buddy count (set with the epoch's membership); the
        # committed step's partial holders and verified twins; ranks to push whole.
        self._twin_reports: dict[int, dict[int, Report]] = {}
        self.domains: dict[int, tuple[int, int]] = {}
        self.committed_partial: dict[int, set[int]] = {}
        self.committed_twins: dict[int, tuple[int, ...]] = {}
        self.committed_absent: dict[int, tuple[int, ...]] = {}  # rank → chunks its partials lack
        self.short: list[tuple[int, int]] = []  # (rank, step) found short by the last record
        self.layouts_owed: list[int] = []  # ranks whose layout the last complete step lacked
        # Erasure coding (``recovery/erasure.py``): this epoch's groups, the committed step's,
        # the nodes lost since it committed, and the ranks lost beyond a rebuild.
        self.coding: Coding | None = None
        self.committed_coding: Coding | None = None
        self.lost_nodes: set[int] = set()
        self.unrebuildable: list[int] = []

    def __repr__(self) -> str:
        return (
            f"CommitTracker(epoch={self.epoch}, ranks={len(self.ranks)}, gen={self.gen}, "
            f"committed_step={self.committed_step}, committed_gen={self.committed_gen})"
        )

    @property
    def committed_layouts(self) -> dict[int, list[Any]]:
        """Each rank's chunk layout of the committed step (its blob resized to that step's)."""
        if self._committed_layouts is None:
            base, sizes = self._committed_base, self._committed_sizes
            self._committed_layouts = {
                r: _with_meta_size(base[r], sizes.get(r)) for r in self.ranks
            }
        return self._committed_layouts

    @committed_layouts.setter
    def committed_layouts(self, layouts: dict[int, list[Any]]) -> None:
        self._committed_layouts = layouts

    def set_layout(self, rank: int, layout: list[Any]) -> None:
        """A rank's chunk layout, known from elsewhere (a restarted coordinator's rebuild)."""
        if rank not in self._layouts:
            self._set_layout(rank, layout)

    def _set_layout(self, rank: int, layout: list[Any]) -> None:
        if self._layouts_shared:  # the committed step keeps the layouts it had
            self._layouts, self._layouts_shared = dict(self._layouts), False
        self._layouts[rank] = layout
        self._table.add(rank, layout)

    def held_lists(self) -> ChunkLists:
        """The committed layouts as the planner's held side (``recovery/planning/tables.py``):
        the table made as they arrived, the rest (blobs, private state) made now."""
        layouts = self.committed_layouts
        table = self.committed_table
        if table is not None:
            meta = None
            for rank in table.ranks:  # a rebuild may have replaced some since
                layout = layouts.get(rank)
                if not isinstance(layout, ChunkColumns) or (meta or layout.meta) != layout.meta:
                    table = None
                    break
                meta = layout.meta
        return from_columns(layouts, HeldChunk, rename=True, table=table)

    def record(
        self,
        epoch: int,
        rank: int,
        step: int,
        holders: list[int],
        layout: list[Any] | None = None,
        meta_nbytes: int | None = None,
        twins: str = "",
        partial: bool = False,
        absent: tuple[int, ...] = (),
    ) -> int | None:
        """Record that ``rank``'s snapshot of ``step`` now lives on ``holders``.

        ``layout`` (its chunks) comes on a rank's first report of the epoch and when it
        changed; ``meta_nbytes``, the size of its blob, with every report.
        Returns the step that this report committed, if any.
        """
        if epoch != self.epoch:
            raise StaleEpoch(
                f"replication report for epoch {epoch} arrived in epoch {self.epoch}; ignored"
            )
        if rank not in self.ranks:
            raise StaleEpoch(f"rank {rank} is not a member of epoch {self.epoch}")
        if self.committed_step is not None and step <= self.committed_step:
            return None
        self.last_replicated[rank] = max(step, self.last_replicated.get(rank, -1))
        if layout is not None:
            self._set_layout(rank, layout)
        by_rank = self._pending.setdefault(step, {})
        if twins or partial:  # redundancy-aware replication: its twins are checked at commit
            node = self.domains.get(rank, (holders[0] if holders else -1, 0))[0]
            report = Report(node, frozenset(holders), twins, partial, tuple(absent))
            self._twin_reports.setdefault(step, {})[rank] = report
            by_rank[rank] = complete_nodes(report)
        else:  # a whole copy on every holder: nothing to verify (8,000 of them a second)
            self._twin_reports.get(step, {}).pop(rank, None)  # it replaces a partial one
            by_rank[rank] = set(holders)
        if meta_nbytes is not None:
            self._meta.setdefault(step, {})[rank] = meta_nbytes
        self.short, self.layouts_owed = [], []
        if len(by_rank) != len(self.ranks):  # only members are counted: every one has it
            return None
        reports = self._twin_reports.get(step, {})
        buddies = {r: self.domains.get(r, (-1, 1 << 30))[1] for r in reports}
        verdict = verify(reports, buddies, self.coding)
        if verdict.short:  # too few twins hold their chunks: push (or code) them whole first
            self.short = [(r, step) for r in verdict.short]
            return None
        if not self._all_layouts:
            # A report carrying a layout was not taken (timed out): its agent sends the layout
            # with the rank's next report (``CoordinatorLink``), and a later step commits.
            # Refusing this report would blame a rank that reported everything.
            self.layouts_owed = sorted(r for r in self.ranks if r not in self._layouts)
            if self.layouts_owed:
                return None
            self._all_layouts = True
        self.committed_step = step
        self.committed_gen = self.gen
        self.committed_holders = by_rank
        self.committed_coding, self.lost_nodes, self.unrebuildable = self.coding, set(), []
        self.committed_partial = {r: partial_nodes(reports[r]) for r in verdict.twins}
        self.committed_twins = verdict.twins
        self.committed_absent = {r: reports[r].absent for r in verdict.twins}
        if self._committed_base is not self._layouts or self.committed_table is None:
            self.committed_table = self._table.table()  # the arrays as they are: no copy
        self._committed_base, self._layouts_shared = self._layouts, True
        self._committed_sizes = self._meta.get(step, {})
        self._committed_layouts = None
        for older in [s for s in self._pending if s <= step]:
            del self._pending[older]
            self._meta.pop(older, None)
            self._twin_reports.pop(older, None)
        return step

    def forget_node(self, node: int) -> None:
        """A node was lost: it no longer holds anything."""
        for holders in [*self.committed_holders.values(), *self.committed_partial.values()]:
            holders.discard(node)
        for by_rank in self._pending.values():
            for holders in by_rank.values():
                holders.discard(node)
        self.lost_nodes.add(node)
        self.unrebuildable = mark_rebuildable(
            self.committed_coding, self.committed_holders, self.lost_nodes, self.committed_twins
        )

    def add_holder(self, rank: int, node: int) -> None:
        """A recovery copied ``rank``'s committed snapshot to ``node``."""
        self.committed_holders.setdefault(rank, set()).add(node)
