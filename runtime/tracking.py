"""What ``Context.track`` and ``Context.steps`` do in a rank: restore, then snapshot each step.

``Tracking`` is mixed into ``RankRuntime`` (``runtime/rank.py``), which owns the epoch loop
and the link to the agent. ``track`` registers the objects and, when the epoch restores,
loads them: from the rank's own slot in the same topology (mapped once, no network), or,
after a topology change, by sending the boxes it wants and reading the staging segment its
agent gathered. ``steps`` applies the saved RNG states, resumes after the restored step, and
hands every finished step to the snapshot engine.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from peerckpt.errors import MembershipChanged, StateMismatch
from peerckpt.manifest import META_KEY, ChunkRecord
from peerckpt.messages.control import Shutdown
from peerckpt.messages.local import RankResumed, ReleaseStaging, WantChunks
from peerckpt.runtime import capture
from peerckpt.runtime.audit import FirstStepWatch
from peerckpt.runtime.restore import (
    ChunkSource,
    OldLayout,
    read_meta,
    restore_objects,
    wanted_chunks,
)
from peerckpt.runtime.state import Assignment, RankState
from peerckpt.states import EpochMode

if TYPE_CHECKING:
    from peerckpt.runtime.channel import AgentChannel
    from peerckpt.runtime.env import LaunchEnv
    from peerckpt.runtime.pg import ProcessGroupLifecycle
    from peerckpt.runtime.snapshot import SnapshotEngine

log = logging.getLogger("peerckpt.rank")


class RestoreCost:
    """What a restore cost this process, from its start to ``summary()``: wall time, CPU time
    (every thread), minor page faults and involuntary context switches.

    CPU time well below the wall time means the copy waited for a core rather than ran slowly;
    about one fault per 4 KiB restored means it wrote memory nothing had touched yet.
    """

    def __init__(self) -> None:
        self._start = self._now()

    @staticmethod
    def _now() -> tuple[float, float, int, int]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime
        return time.perf_counter(), cpu, usage.ru_minflt, usage.ru_nivcsw

    def summary(self) -> str:
        wall, cpu, faults, preempted = (
            end - start for start, end in zip(self._start, self._now(), strict=True)
        )
        return (
            f"{wall:.3f} s ({cpu:.3f} s CPU, {int(faults)} page faults, "
            f"preempted {int(preempted)} times)"
        )


class Tracking:
    """Restore and snapshot. Expects the rank runtime's state (declared for type checking)."""

    env: LaunchEnv
    state: RankState
    assignment: Assignment | None
    tracked: dict[str, Any]
    step: int | None
    channel: AgentChannel
    engine: SnapshotEngine
    pg: ProcessGroupLifecycle
    _cond: threading.Condition
    _shutdown: Shutdown | None
    _restored: dict[str, Any] | None
    _hooks: list[Any]
    _resumed_sent: bool
    _staging: dict[tuple[int, int], tuple[str, list[ChunkRecord]]]
    _round: int
    _watch: FirstStepWatch | None = None  # this epoch's first-step hooks (runtime/audit.py)
    _audit_pending = True  # the audit of the loop runs once per process

    if TYPE_CHECKING:  # provided by RankRuntime

        def check(self) -> None: ...

    def track(self, state: dict[str, Any]) -> None:
        assert self.assignment is not None
        clash = sorted(set(state) & set(self.tracked))
        if clash:
            raise StateMismatch(f"ctx.track got {clash} twice in one epoch; track each name once")
        self.check()
        if self._watch is None or self._watch.tracked is not self.tracked:
            self._start_watch()
        self.tracked.update(state)
        for obj in state.values():
            if isinstance(obj, torch.optim.Optimizer):
                self._hooks.append(obj.register_step_pre_hook(self._before_optimizer_step))
        a = self.assignment
        if a.mode is EpochMode.RESHARD:
            self._restore_resharded(state)
            return
        if a.mode is not EpochMode.SAME or a.restore_slot is None:
            return
        cost = RestoreCost()
        slot = self.engine.slot_tensor(a.restore_slot)
        source = ChunkSource(a.chunks, slot=slot)
        meta = read_meta(slot, next(c for c in a.chunks if c.key == META_KEY))
        restore_objects(
            state,
            self.tracked,
            source,
            {a.rank: meta},
            primary=a.rank,
            rank=a.rank,
            world_size=a.world_size,
            resharded=False,
        )
        self._watching().ddp.restore(meta.get("ddp", {}))
        self._restored = meta
        log.info("restored %s from step %d in %s", sorted(state), meta["step"], cost.summary())

    def _restore_resharded(self, state: dict[str, Any]) -> None:
        """Restore ``state`` into this epoch's new layout: say which boxes this rank needs,
        wait for the agent to gather them (every rank of the epoch does the same, then the
        coordinator plans the reads of all of them at once), and load them."""
        a = self.assignment
        assert a is not None and a.old_layout is not None
        old = OldLayout.from_msg(a.old_layout)
        primary = a.previous_rank if a.previous_rank is not None else a.rank % a.old_world
        wants = wanted_chunks(state, self.tracked, old, primary)
        round_ = self._round
        self._round += 1
        asked = time.perf_counter()
        self.channel.notify(WantChunks(a.epoch, a.rank, round_, [w.to_msg() for w in wants]))
        with self._cond:
            while (a.epoch, round_) not in self._staging:
                if self.state is RankState.ABORTING or self._shutdown is not None:
                    raise MembershipChanged("the job's membership changed during a restore")
                self._cond.wait()
            path, chunks = self._staging.pop((a.epoch, round_))
        gathered = time.perf_counter()
        cost = RestoreCost()
        # Read, not mapped: each byte is copied once, straight into its destination.
        fd = os.open(path, os.O_RDONLY)
        try:
            source = ChunkSource(chunks, fd=fd)
            metas = source.metas()
            restore_objects(
                state, self.tracked, source, metas, primary, a.rank, a.world_size, resharded=True
            )
        finally:
            os.close(fd)
            self.channel.notify(ReleaseStaging(a.epoch, a.rank, round_))
        # The model is the same model, whatever the world size: its DDP buckets too.
        self._watching().ddp.restore(metas[primary].get("ddp", {}))
        self._restored = metas[primary]
        log.info(
            "restored %s from step %s into a new layout (world %d, was %d): %.3f s planning "
            "and gathering, %s copying into place",
            sorted(state),
            a.restore_step,
            a.world_size,
            a.old_world,
            gathered - asked,
            cost.summary(),
        )

    def _start_watch(self) -> None:
        """Watch this epoch's first step (``runtime/audit.py``): DDPs that wrap tracked modules,
        and, once per process, what the loop uses that is not tracked. The audit runs in a rank
        that started the job (spares run the same script: they would only repeat it)."""
        assert self.assignment is not None
        audit = self._audit_pending and (
            self.assignment.restore_step is None or self.env.role == "rank"
        )
        self._watch = FirstStepWatch(self.tracked, audit=audit)
        self._hooks.append(self._watch)  # removed when the epoch is left, whatever happens

    def _watching(self) -> FirstStepWatch:
        assert self._watch is not None
        return self._watch

    def _before_optimizer_step(self, *args: Any) -> None:
        self.engine.guard_step()

    def steps(self, total: int) -> Iterator[int]:
        assert self.assignment is not None
        a = self.assignment
        start = 0
        if a.restore_step is not None:
            if self._restored is None:
                raise StateMismatch(
                    f"epoch {a.epoch} restores step {a.restore_step}, but nothing was tracked: "
                    "call ctx.track(model=…, optim=…) before ctx.steps()"
                )
            capture.restore_rng(self._restored["rng"])
            start = a.restore_step + 1
        self._resumed(start)
        watch = self._watch
        if watch is not None and watch.tracked is not self.tracked:
            watch = None  # an earlier epoch's: nothing was tracked in this one
        for step in range(start, total):
            self.check()
            self.step = step
            yield step
            self.check()
            extra = {"ddp": watch.ddp.layouts() if watch is not None else {}}
            self.engine.take(step, capture.capture(self.tracked, step, extra))
            if step == start and watch is not None:
                self._audit_pending = self._audit_pending and not watch.audit
                watch.finish()  # the first snapshot: the hooks go, the audit speaks
            if self.engine.committed_step is not None and self.engine.committed_step >= start:
                self.pg.release_retired()  # this epoch committed: the old groups are idle

    def _resumed(self, start: int) -> None:
        if self._resumed_sent or self.assignment is None:
            return
        self._resumed_sent = True
        self.channel.notify(RankResumed(self.assignment.epoch, self.assignment.rank, start))
