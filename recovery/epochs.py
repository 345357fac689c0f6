"""How the coordinator changes its membership: the first epoch, spares replacing lost ranks,
shrinking when no spare is left, growing when a node joins.

``EpochChanges`` is mixed into ``Coordinator`` (``recovery/coordinator.py``); its methods run
under the coordinator's lock and change only the coordinator's own state, then broadcast the
new membership to the agents. The arithmetic of who becomes which rank lives in
``recovery/elastic.py``, the choice of restore sources in ``recovery/planning/sources.py``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from peerckpt.errors import CheckpointError, CorruptCheckpoint, NoCheckpoint, RecoveryFailed
from peerckpt.membership import Membership, RankAssignment
from peerckpt.persist.durable import DurableCheckpoint, DurableStore
from peerckpt.reads import STORAGE
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.elastic import grown, old_layout_summary, replaced, shrunk
from peerckpt.recovery.planning.sources import plan_sources

if TYPE_CHECKING:
    from peerckpt.recovery.coordinator import AgentInfo, ProcInfo
    from peerckpt.recovery.flushes import FlushScheduler
    from peerckpt.recovery.placement import Placement

log = logging.getLogger("peerckpt.coordinator")

SPARE_WAIT_S = 60.0  # how long a recovery waits for spares the launcher started to join


@dataclass
class DeferredRecovery:
    """Ranks lost while too few spares had joined but more were still starting."""

    kind: str
    ranks: set[int]
    nodes: set[int]
    reason: str
    detected_at: float
    deadline: float  # time.monotonic(): then the recovery goes on with what has joined
    never_joined: int = 0  # spares given up on when the wait ran out


class EpochChanges:
    """Opening epochs. Expects the coordinator's state (declared here for type checking)."""

    agents: dict[int, AgentInfo]
    procs: dict[tuple[int, int], ProcInfo]
    membership: Membership | None
    tracker: CommitTracker | None
    placement: Placement
    state: str
    world_size: int
    replicas: int | None
    min_nodes: int | None
    store_addr: str
    events: list[dict[str, Any]]
    done: set[int]
    resumed: set[int]
    snapshot_bytes: dict[int, int]
    spares_started: int
    spares_joined: int
    _deferred: DeferredRecovery | None

    flusher: FlushScheduler | None

    if TYPE_CHECKING:  # provided by Coordinator

        def _member_rank(self, proc: ProcInfo) -> int | None: ...
        def _fail(self, reason: str) -> None: ...
        def _broadcast(self, event: dict[str, Any]) -> None: ...

    def _maybe_grow(self) -> None:
        """Once every process of a joining node has connected, widen the world to include it."""
        if self.state != "running" or self.membership is None:
            return
        for agent in sorted(self.agents.values(), key=lambda a: a.node):
            joiners = sorted(
                (
                    p
                    for p in self.procs.values()
                    if p.node == agent.node and p.role == "joiner" and p.alive
                ),
                key=lambda p: p.pid,
            )
            if not agent.alive or not agent.joining or len(joiners) < agent.joining:
                continue
            agent.joining = 0
            event = self._event("grow", set(), {agent.node}, f"node {agent.node} joined")
            assignments, previous = grown(self.membership.ranks, [(p.node, p.pid) for p in joiners])
            for p, rank in zip(
                joiners, sorted(set(assignments) - set(self.membership.ranks)), strict=True
            ):
                p.role, p.rank = "rank", rank
            event["grown_to"] = len(assignments)
            self._change(event, assignments, previous)

    def _maybe_open_first_epoch(self) -> None:
        ranks = {
            p.rank: p
            for p in self.procs.values()
            if p.role == "rank" and p.alive and p.rank is not None
        }
        if set(ranks) != set(range(self.world_size)):
            return
        if self.replicas is None:
            self.replicas = 1
        assignments = {r: RankAssignment(r, p.node, p.pid) for r, p in ranks.items()}
        if not self._cold_start(assignments):
            self._open_epoch(0, assignments, restore_step=None, sources={})
        self.state = "running"
        self._maybe_grow()

    def _durable_to_restore(self, url: str) -> DurableCheckpoint:
        """The latest committed step; with ``allow_older``, the latest that verifies."""
        store = DurableStore(url)
        assert self.flusher is not None
        if not self.flusher.config.allow_older:
            return store.open()  # damage is found (and named) as the ranks load it
        steps = store.committed_steps()
        for step in reversed(steps):
            try:
                ckpt = store.open(step)
                problems = ckpt.verify()
            except CorruptCheckpoint as exc:  # its manifest is malformed: as damaged
                problems = [str(exc)]
            if not problems:
                return ckpt
            log.warning(
                "step %d in %s is damaged (%s); --allow-older: trying the step before it",
                step,
                url,
                problems[0],
            )
        if steps:
            raise CheckpointError(f"every committed step in {url} ({steps}) is damaged")
        raise NoCheckpoint(f"no committed checkpoint in {url}")

    def _restore_from_storage(
        self,
        ckpt: DurableCheckpoint,
        url: str,
        event: dict[str, Any],
        epoch: int,
        gen: int,
        assignments: dict[int, RankAssignment],
        previous: dict[int, int | None] | None = None,
        with_memory: bool = False,
    ) -> None:
        """Open ``epoch`` restoring durable step ``ckpt`` into ``assignments``, resharded.

        Normally the stored step becomes the committed state, storage its only holder.
        ``with_memory`` (the stored step *is* the committed step): storage joins the memory
        holders, and the planner reads it only where no memory copy survived."""
        m = ckpt.manifest
        if with_memory:
            assert self.tracker is not None
            for holders in self.tracker.committed_holders.values():
                holders.add(STORAGE)
        else:
            layouts = {r: [c.record.to_msg() for c in cs] for r, cs in m.ranks.items()}
            self.tracker = CommitTracker(
                epoch=epoch - 1,
                ranks=frozenset(layouts),
                gen=gen - 1,
                committed_step=m.step,
                committed_gen=gen - 1,
                committed_holders={r: {STORAGE} for r in layouts},
                committed_layouts=layouts,
            )
        event.update(
            restore_step=m.step, mode="reshard", epoch=epoch, url=url, old_world=m.world_size
        )
        self._open_epoch(
            epoch,
            assignments,
            m.step,
            {},
            "reshard",
            gen=gen,
            previous=previous or {},
            old_world=m.world_size,
            restore_url=url,
        )

    def _storage_fallback(
        self,
        event: dict[str, Any],
        assignments: dict[int, RankAssignment],
        why: str,
        previous: dict[int, int | None],
        partial: bool = True,
    ) -> bool:
        """No memory copy of some state survived: storage fills the gap.

        If the latest durable step is the committed step, only what no memory copy holds is
        read from storage, the rest from the peers' memory. Otherwise the job goes on from the
        durable step, and the steps after it are trained again (deterministically, so the
        bits come out the same). False if there is no durable tier, no checkpoint, or this
        epoch already reads from storage. ``partial=False``: always the whole job from storage
        (when a surviving memory copy turned out corrupt, memory is not trusted for that step).
        """
        m, tracker = self.membership, self.tracker
        if self.flusher is None or m is None or tracker is None or m.restore_url is not None:
            return False
        url = self.flusher.config.url
        try:
            ckpt = self._durable_to_restore(url)
        except (CheckpointError, OSError) as exc:
            log.error("no memory copy survived (%s) and storage cannot help: %s", why, exc)
            return False
        if partial and ckpt.step == tracker.committed_step and _same_chunks(ckpt, tracker):
            log.warning(
                "no memory copy survived (%s); step %d is also in %s: reading what was lost "
                "from there and the rest from memory",
                why,
                ckpt.step,
                url,
            )
            event["fallback"] = f"{why}; read the lost chunks of step {ckpt.step} from storage"
            event["partial"] = True
            self._restore_from_storage(
                ckpt, url, event, m.epoch + 1, m.gen + 1, assignments, previous, with_memory=True
            )
            return True
        log.warning(
            "no memory copy survived (%s); falling back to durable step %d in %s",
            why,
            ckpt.step,
            url,
        )
        event["fallback"] = f"{why}; restored durable step {ckpt.step}"
        self._restore_from_storage(ckpt, url, event, m.epoch + 1, m.gen + 1, assignments)
        return True

    def _cold_start(self, assignments: dict[int, RankAssignment]) -> bool:
        """A job starting with a durable checkpoint restores its latest committed step from
        storage, resharded into this job's topology. False if there is none to restore."""
        if self.flusher is None:
            return False
        url = self.flusher.config.url
        try:
            ckpt = self._durable_to_restore(url)
        except NoCheckpoint as exc:
            log.info("%s: a fresh start", exc)
            return False
        except (CheckpointError, OSError) as exc:
            self._fail(f"cannot read the durable checkpoints in {url}: {exc}")
            return True
        event = self._event("cold_start", set(), set(), f"restored step {ckpt.step} from {url}")
        log.info(
            "cold start: restoring step %d (%d ranks) from %s into %d ranks",
            ckpt.step,
            ckpt.manifest.world_size,
            url,
            len(assignments),
        )
        self._restore_from_storage(ckpt, url, event, 0, 1, assignments)
        return True

    def _recover(
        self,
        kind: str,
        ranks: set[int],
        nodes: set[int],
        reason: str,
        deferred: DeferredRecovery | None = None,
    ) -> None:
        if self.state != "running" or self.membership is None or self.tracker is None:
            return
        if deferred is None and self._deferred is not None:
            # A recovery is waiting for spares: this loss joins it (one epoch change for both).
            d = self._deferred
            d.ranks |= ranks
            d.nodes |= nodes
            d.reason = f"{d.reason}; {reason}"
            d.kind = "node" if "node" in (d.kind, kind) else d.kind
            self._retry_deferred()
            return
        old = self.membership
        spares = self._joined_spares()
        starting = self.spares_started - self.spares_joined
        if len(spares) < len(ranks) and starting > 0:
            if deferred is None:
                deferred = DeferredRecovery(
                    kind, ranks, nodes, reason, time.time(), time.monotonic() + SPARE_WAIT_S
                )
                log.warning(
                    "lost rank(s) %s (%s); %d spare(s) joined, %d still starting: the "
                    "recovery waits up to %.0f s for them",
                    sorted(deferred.ranks),
                    deferred.reason,
                    len(spares),
                    starting,
                    SPARE_WAIT_S,
                )
            if time.monotonic() < deferred.deadline:
                self._deferred = deferred
                return
        event = self._event(kind, ranks, nodes, reason)
        if deferred is not None:
            event["detected_at"] = deferred.detected_at
            event["waited_for_spares_s"] = round(time.time() - deferred.detected_at, 3)
        if len(spares) >= len(ranks):
            assignments, previous = replaced(old.ranks, ranks, [(p.node, p.pid) for p in spares])
            for rank, spare in zip(sorted(ranks), spares, strict=False):
                spare.role, spare.rank = "rank", rank
            event["replacements"] = {
                r: [assignments[r].node, assignments[r].pid] for r in sorted(ranks)
            }
        elif self.min_nodes is not None:
            assignments, previous = shrunk(old.ranks, ranks)
            remaining = {a.node for a in assignments.values()}
            if len(remaining) < self.min_nodes:
                self._fail(
                    f"lost rank(s) {sorted(ranks)} ({reason}); {len(remaining)} node(s) would be "
                    f"left, fewer than --min-nodes {self.min_nodes}, and no spare is left"
                )
                return
            event["shrunk_to"] = len(assignments)
        else:
            missing = starting or (deferred.never_joined if deferred else 0)
            never = f" ({missing} more never joined)" if missing else ""
            self._fail(
                f"lost rank(s) {sorted(ranks)} ({reason}) and only {len(spares)} spare(s) are "
                f"left{never}; start the job with more --spares, or let it shrink with --min-nodes"
            )
            return
        self._change(event, assignments, previous)

    def _joined_spares(self) -> list[ProcInfo]:
        """Spares ready to take a rank: alive, on a live node, not in the membership."""
        return sorted(
            (
                p
                for p in self.procs.values()
                if p.role == "spare"
                and p.alive
                and self._member_rank(p) is None
                and self.agents[p.node].alive
            ),
            key=lambda p: (not self.agents[p.node].spare_node, p.node, p.pid),
        )

    def _retry_deferred(self, force: bool = False) -> None:
        """A spare joined (or the wait ran out, ``force``): go on with a deferred recovery."""
        d = self._deferred
        if d is None:
            return
        short = len(self._joined_spares()) < len(d.ranks)
        if not force and short and self.spares_started > self.spares_joined:
            return  # more are coming; keep waiting
        self._deferred = None
        if force:
            log.warning(
                "%d spare(s) did not join within %.0f s; recovering without them",
                self.spares_started - self.spares_joined,
                SPARE_WAIT_S,
            )
            d.never_joined = self.spares_started - self.spares_joined
            self.spares_started = self.spares_joined  # they are not coming
            d.deadline = 0.0
        self._recover(d.kind, d.ranks, d.nodes, d.reason, deferred=d)

    def _event(self, kind: str, ranks: set[int], nodes: set[int], reason: str) -> dict[str, Any]:
        """Record a membership event (before the first epoch: a cold start, nothing lost)."""
        old = self.membership
        event: dict[str, Any] = {
            "kind": kind,
            "ranks": sorted(ranks),
            "nodes": sorted(nodes),
            "reason": reason,
            "lost": {r: old.ranks[r].node for r in sorted(ranks)} if old else {},
            "detected_at": time.time(),
            "from_epoch": old.epoch if old else -1,
            "pulls": [],
            "resumed_at": None,
        }
        self.events.append(event)
        return event

    def _change(
        self,
        event: dict[str, Any],
        assignments: dict[int, RankAssignment],
        previous: dict[int, int | None],
    ) -> None:
        """Open the next epoch for ``assignments``, restoring the last committed step."""
        assert self.membership is not None and self.tracker is not None
        old, tracker = self.membership, self.tracker
        restore = tracker.committed_step
        same = (
            restore is not None
            and tracker.committed_gen == old.gen
            and len(assignments) == len(old.ranks)
            and all(previous.get(r) in (r, None) for r in assignments)
        )
        mode = "same" if same else ("reshard" if restore is not None else "fresh")
        sources: dict[int, list[int]] = {}
        if mode == "same":
            try:
                sources = plan_sources(
                    {r: a.node for r, a in assignments.items()},
                    {r: set(h) - {STORAGE} for r, h in tracker.committed_holders.items()},
                    self.snapshot_bytes,
                    {r: a.node for r, a in old.ranks.items()},
                )
            except RecoveryFailed as exc:
                if not self._storage_fallback(event, assignments, str(exc), previous):
                    self._fail(str(exc))
                return
        event["restore_step"] = restore
        event["mode"] = mode
        self._open_epoch(
            old.epoch + 1,
            assignments,
            restore,
            sources,
            mode,
            gen=old.gen if mode == "same" else old.gen + 1,
            previous=previous,
            old_world=len(old.ranks),
        )
        event["epoch"] = old.epoch + 1

    def _open_epoch(
        self,
        epoch: int,
        assignments: dict[int, RankAssignment],
        restore_step: int | None,
        sources: dict[int, list[int]],
        mode: str = "fresh",
        gen: int = 0,
        previous: dict[int, int | None] | None = None,
        old_world: int = 0,
        restore_url: str | None = None,
    ) -> None:
        rank_nodes = {r: a.node for r, a in assignments.items()}
        old = self.tracker
        layouts = old.committed_layouts if old else {}
        self.world_size = len(assignments)
        self.membership = Membership(
            epoch=epoch,
            world_size=self.world_size,
            ranks=assignments,
            placement=self.placement.buddies(rank_nodes, self.replicas or 0),
            restore_step=restore_step,
            sources=sources,
            node_addrs={n: a.data_addr for n, a in self.agents.items() if a.alive},
            store_addr=self.store_addr,
            mode=mode,
            gen=gen,
            restore_gen=old.committed_gen if old else 0,
            previous=previous or {},
            old_world=old_world,
            old_layout=old_layout_summary(layouts) if mode == "reshard" else None,
            restore_url=restore_url,
        )
        self.tracker = CommitTracker(
            epoch=epoch,
            ranks=frozenset(assignments),
            gen=gen,
            committed_step=restore_step,
            committed_gen=old.committed_gen if old else 0,
            committed_holders={
                r: set(h) for r, h in (old.committed_holders if old else {}).items()
            },
            committed_layouts=dict(layouts),
        )
        self.done.clear()
        self.resumed.clear()
        log.info(
            "epoch %d opened (%s, layout %d): restore step %s, ranks %s",
            epoch,
            mode,
            gen,
            restore_step,
            rank_nodes,
        )
        self._broadcast(self.membership.to_msg())


def _same_chunks(ckpt: DurableCheckpoint, tracker: CommitTracker) -> bool:
    """Does the durable step hold every rank's chunks as the committed layout describes them?"""
    stored = {r: {_box(c.record.to_msg()) for c in cs} for r, cs in ckpt.manifest.ranks.items()}
    committed = {r: {_box(c) for c in cs} for r, cs in tracker.committed_layouts.items()}
    return stored == committed


def _box(chunk: list[Any]) -> tuple[Any, ...]:
    """(key, offsets, lengths) of a chunk record in its message form."""
    return (chunk[0], tuple(chunk[3]), tuple(chunk[4]))
