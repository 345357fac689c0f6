"""The coordinator's epoch decision, as pure functions: (job view, change) → decision.

Nothing here does I/O, reads a clock or changes its inputs; ``recovery/epochs.py`` gathers a
``JobView`` under the coordinator's lock, asks, and carries out the answer. So every rule
of who replaces whom, when the world shrinks or grows, what a new epoch restores and from
where, is unit-tested without a process (``tests/recovery/test_decide.py``).

A ``Loss`` (ranks gone, with their nodes) is decided as:

0. restart-based (torchrun): some member still alive, or restarted workers still starting,
   and the wait not over → ``Wait`` (torchrun restarts every worker after any failure);
1. fewer spares joined than ranks lost, but more starting and the wait not over → ``Wait``
   (a rank the coordinator restarts in place counts as a spare starting on its node: the
   shell asks ``restarts_in_place`` first, orders those restarts, then decides);
2. enough spares → they take the lost ranks, those on a lost rank's node first
   (``elastic.replaced``);
3. else, if the job may shrink (``min_nodes``) and enough nodes remain → the survivors are
   renumbered (``elastic.shrunk``), or, none survived (every worker restarted), the
   restarted processes form the world (``elastic.restarted``);
4. else ``Fail``, naming the ranks, the reason and the fix.

A ``Join`` (a node's joiners all connected) always grows the world (``elastic.grown``).
Then the new epoch: ``SAME`` mode when the layout is unchanged (each rank restores its own
snapshot, replacements pull it, ``planning.sources`` orders the holders), ``RESHARD`` when
it changed, ``FRESH`` when nothing is committed yet. A ``SAME`` epoch some of whose ranks
have no surviving copy is ``NeedStorage``: the shell tries the durable tier, or fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from peerckpt.errors import RecoveryFailed
from peerckpt.membership import Membership, RankAssignment
from peerckpt.reads import STORAGE
from peerckpt.recovery.commits import CommitTracker
from peerckpt.recovery.elastic import grown, old_layout_summary, replaced, restarted, shrunk
from peerckpt.recovery.placement import Placement
from peerckpt.recovery.twins import domains_of, recovery_sources
from peerckpt.states import EPOCH_MODE, EpochMode, RecoveryKind

Proc = tuple[int, int]  # (node, pid)


@dataclass(frozen=True)
class Topology:
    """Where an epoch's processes and copies are: buddy placement and addresses."""

    placement: Placement
    replicas: int
    node_addrs: Mapping[int, str]  # the live agents' data addresses
    store_addr: str  # the torch.distributed store every epoch's group meets in


@dataclass(frozen=True)
class JobView:
    """What an epoch decision reads. ``tracker`` is read, never changed."""

    membership: Membership
    tracker: CommitTracker
    snapshot_bytes: Mapping[int, int]
    spares: tuple[Proc, ...]  # joined spares, best first (spare nodes first)
    spares_starting: int  # started by a launcher, not joined yet
    min_nodes: int | None  # None: the world never shrinks
    topology: Topology
    # Restart-based recovery (torchrun): a loss makes every worker restart, so a decision
    # waits until no member of the epoch is alive and the restarted processes have joined.
    restart_based: bool = False
    members_alive: int = 0  # processes of the current epoch not lost yet
    # Restart in place (``restarts_in_place``): how many times a rank may be restarted on its
    # node over the job (``--max-restarts``; 0: never), how many times each was, and the
    # nodes where a launcher of the job would start the fresh process (agent alive).
    max_restarts: int = 0
    restarts: Mapping[int, int] = field(default_factory=dict)
    restartable_nodes: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Loss:
    """Ranks lost, and the nodes lost with them. ``restarted``: those of ``ranks`` whose
    process is restarted in place (a survivor that could not leave an aborted epoch; a fresh
    process on its healthy node takes the rank). ``deadline``: until then a recovery may wait
    for spares still starting (set once it waits); ``never_joined``: spares given up on;
    ``ordered``: those of ``ranks`` the coordinator ordered restarted in place on their node."""

    kind: RecoveryKind  # RANK, NODE, or RENDEZVOUS (a restarted coordinator's regroup)
    ranks: frozenset[int]
    nodes: frozenset[int]
    reason: str
    detected_at: float
    deadline: float | None = None
    never_joined: int = 0
    restarted: frozenset[int] = frozenset()
    ordered: frozenset[int] = frozenset()

    def merged(self, other: Loss) -> Loss:
        """One recovery for both losses (the second struck while the first waited)."""
        return Loss(
            RecoveryKind.NODE if RecoveryKind.NODE in (self.kind, other.kind) else self.kind,
            self.ranks | other.ranks,
            self.nodes | other.nodes,
            f"{self.reason}; {other.reason}",
            self.detected_at,
            self.deadline,
            self.never_joined,
            self.restarted | other.restarted,
            self.ordered | other.ordered,
        )


@dataclass(frozen=True)
class Join:
    """Every joiner of a node has connected: (node, pid) in the order they become ranks."""

    node: int
    joiners: tuple[Proc, ...]


@dataclass(frozen=True)
class OpenEpoch:
    """Open ``membership``, tracking commits with ``tracker``. ``promoted``: spares or
    joiners that become ranks; ``replacements``/``shrunk_to``/``grown_to`` for the record."""

    membership: Membership
    tracker: CommitTracker
    promoted: dict[Proc, int] = field(default_factory=dict)
    replacements: dict[int, list[int]] = field(default_factory=dict)
    shrunk_to: int | None = None
    grown_to: int | None = None


@dataclass(frozen=True)
class Wait:
    """Too few spares joined, more are starting: wait for them until ``loss.deadline``."""

    loss: Loss


@dataclass(frozen=True)
class Fail:
    reason: str


@dataclass(frozen=True)
class NeedStorage:
    """No memory copy of some rank's committed state survived (``why``): only the durable
    tier can help, restoring into ``assignments``."""

    why: str
    assignments: dict[int, RankAssignment]
    previous: dict[int, int | None]


Decision = OpenEpoch | Wait | Fail | NeedStorage


def decide_loss(view: JobView, loss: Loss, now: float, spare_wait_s: float) -> Decision:
    """What to do about ``loss`` (``now`` and ``deadline`` on the monotonic clock)."""
    old = view.membership
    ranks = loss.ranks
    if view.restart_based and (view.members_alive > 0 or view.spares_starting > 0):
        deadline = loss.deadline if loss.deadline is not None else now + spare_wait_s
        if now < deadline:
            return Wait(replace(loss, deadline=deadline))
    if len(view.spares) < len(ranks) and view.spares_starting > 0:
        deadline = loss.deadline if loss.deadline is not None else now + spare_wait_s
        if now < deadline:
            return Wait(replace(loss, deadline=deadline))
    if len(view.spares) >= len(ranks):
        assignments, previous = replaced(old.ranks, set(ranks), list(view.spares))
        return _transition(
            view,
            assignments,
            previous,
            promoted={(assignments[r].node, assignments[r].pid): r for r in sorted(ranks)},
            replacements={r: [assignments[r].node, assignments[r].pid] for r in sorted(ranks)},
        )
    if view.min_nodes is not None:
        assignments, previous = shrunk(old.ranks, set(ranks))
        promoted: dict[Proc, int] = {}
        if not assignments and view.spares:
            assignments, previous = restarted(list(view.spares))
            promoted = {(a.node, a.pid): r for r, a in assignments.items()}
        remaining = {a.node for a in assignments.values()}
        if len(remaining) < view.min_nodes:
            return Fail(
                f"lost rank(s) {sorted(ranks)} ({loss.reason}); {len(remaining)} node(s) would "
                f"be left, fewer than --min-nodes {view.min_nodes}, and no spare is left"
            )
        return _transition(
            view, assignments, previous, promoted=promoted, shrunk_to=len(assignments)
        )
    missing = view.spares_starting or loss.never_joined
    never = f" ({missing} more never joined)" if missing else ""
    note = _no_restart(view, loss)
    more = ", a higher --max-restarts" if note else ""
    return Fail(
        f"lost rank(s) {sorted(ranks)} ({loss.reason}) and only {len(view.spares)} spare(s) are "
        f"left{never}{note}; start the job with more --spares{more}, or let it shrink with "
        "--min-nodes"
    )


def restarts_in_place(view: JobView, loss: Loss) -> dict[int, int]:
    """The ranks of ``loss`` to restart in place now, each on the node it was lost on:
    rank → node. The shell orders them (a launcher starts a fresh process there, counted as
    a spare starting) before it asks ``decide_loss``, which then waits for them.

    A rank whose process died while its node's agent lives has its state in that agent's
    memory: a fresh process on the node restores it with no network. Free spares still come
    first: a spare has started Python and imported torch already and takes the rank at once,
    pulling its state over the network (0.1 s for the test job), where a fresh process needs
    seconds to start (``docs/architecture.md``, One recovery). So only the ranks that spares,
    joined or starting, cannot take are restarted, and only when restarts can take every one
    of them: restarting some while the world stays short would only delay the shrink or the
    failure that follows anyway. A rank is restarted at most ``max_restarts`` times over the
    job; none under torchrun (``restart_based``: it restarts its workers itself), none twice
    for one loss, and none that restarts by itself (``loss.restarted``, a survivor stuck in
    an aborted epoch)."""
    if view.restart_based or view.max_restarts <= 0:
        return {}
    short = len(loss.ranks) - len(view.spares) - view.spares_starting
    if short <= 0:
        return {}
    old = view.membership.ranks
    able = [
        r
        for r in sorted(loss.ranks - loss.restarted - loss.ordered)
        if r in old
        and old[r].node in view.restartable_nodes
        and old[r].node not in loss.nodes
        and view.restarts.get(r, 0) < view.max_restarts
    ]
    if len(able) < short:
        return {}
    return {r: old[r].node for r in able[:short]}


def _no_restart(view: JobView, loss: Loss) -> str:
    """Why no lost rank was restarted in place, when ``--max-restarts`` is why (a rank lost
    with its node cannot be: nothing to say then)."""
    if view.restart_based:
        return ""
    if view.max_restarts <= 0:
        return "; restarting in place is off (--max-restarts 0)"
    spent = sorted(r for r in loss.ranks if view.restarts.get(r, 0) >= view.max_restarts)
    if not spent:
        return ""
    return (
        f"; rank(s) {spent} were restarted in place {view.max_restarts} time(s) already, all "
        f"that --max-restarts {view.max_restarts} allows"
    )


def decide_join(view: JobView, join: Join) -> Decision:
    """A node's joiners all connected: they become the next ranks."""
    assignments, previous = grown(view.membership.ranks, list(join.joiners))
    new = sorted(set(assignments) - set(view.membership.ranks))
    return _transition(
        view,
        assignments,
        previous,
        promoted=dict(zip(join.joiners, new, strict=True)),
        grown_to=len(assignments),
    )


def _transition(
    view: JobView,
    assignments: dict[int, RankAssignment],
    previous: dict[int, int | None],
    **record: object,
) -> Decision:
    """The epoch after ``view.membership`` for ``assignments``: its mode and sources."""
    old, tracker = view.membership, view.tracker
    restore = tracker.committed_step
    same = (
        restore is not None
        and tracker.committed_gen == old.gen
        and len(assignments) == len(old.ranks)
        and all(previous.get(r) in (r, None) for r in assignments)
    )
    mode = EpochMode.SAME if same else EpochMode.RESHARD if restore is not None else EpochMode.FRESH
    sources: dict[int, list[int]] = {}
    fill: dict[int, list[list[int]]] = {}
    if mode is EpochMode.SAME:
        try:
            sources, fill = recovery_sources(  # plan_sources, counting twins (recovery/twins.py)
                {r: a.node for r, a in assignments.items()},
                {r: set(h) - {STORAGE} for r, h in tracker.committed_holders.items()},
                tracker.committed_partial,
                tracker.committed_twins,
                dict(view.snapshot_bytes),
                {r: a.node for r, a in old.ranks.items()},
            )
        except RecoveryFailed as exc:
            return NeedStorage(str(exc), assignments, previous)
    membership, new_tracker = next_epoch(
        view.topology,
        tracker,
        old.epoch + 1,
        assignments,
        restore,
        sources,
        mode,
        gen=old.gen if mode is EpochMode.SAME else old.gen + 1,
        previous=previous,
        old_world=len(old.ranks),
    )
    if fill:
        membership = replace(membership, twins=fill)
    EPOCH_MODE.check(old.mode, mode)
    return OpenEpoch(membership, new_tracker, **record)  # type: ignore[arg-type]


def next_epoch(
    topology: Topology,
    tracker: CommitTracker | None,
    epoch: int,
    assignments: dict[int, RankAssignment],
    restore_step: int | None,
    sources: dict[int, list[int]],
    mode: EpochMode,
    *,
    gen: int,
    previous: dict[int, int | None],
    old_world: int,
    restore_url: str | None = None,
) -> tuple[Membership, CommitTracker]:
    """The membership of ``epoch`` and a fresh commit tracker that keeps what ``tracker``
    (the last one, if any) knew of the committed step."""
    layouts = tracker.committed_layouts if tracker else {}
    rank_nodes = {r: a.node for r, a in assignments.items()}
    membership = Membership(
        epoch=epoch,
        world_size=len(assignments),
        ranks=assignments,
        placement=topology.placement.buddies(rank_nodes, topology.replicas),
        restore_step=restore_step,
        sources=sources,
        node_addrs=dict(topology.node_addrs),
        store_addr=topology.store_addr,
        mode=mode,
        gen=gen,
        restore_gen=tracker.committed_gen if tracker else 0,
        previous=previous,
        old_world=old_world,
        old_layout=old_layout_summary(layouts) if mode is EpochMode.RESHARD else None,
        restore_url=restore_url,
    )
    new_tracker = CommitTracker(
        epoch=epoch,
        ranks=frozenset(assignments),
        gen=gen,
        committed_step=restore_step,
        committed_gen=tracker.committed_gen if tracker else 0,
        committed_holders={
            r: set(h) for r, h in (tracker.committed_holders if tracker else {}).items()
        },
        committed_layouts=dict(layouts),
        committed_table=tracker.committed_table if tracker else None,
    )
    new_tracker.domains = domains_of(membership)
    if tracker is not None:
        new_tracker.committed_partial = {r: set(h) for r, h in tracker.committed_partial.items()}
        new_tracker.committed_twins = dict(tracker.committed_twins)
        new_tracker.committed_absent = dict(tracker.committed_absent)
    return membership, new_tracker
