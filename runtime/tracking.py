"""What ``Context.track`` and ``Context.steps`` do in a rank: restore, then snapshot the steps.

One :class:`EpochTracking` per epoch a process joins (``RankRuntime._join`` makes it, its
``close`` removes its hooks when the epoch is left). ``track`` registers the objects and, when
the epoch restores, loads them: from the rank's own slot in the same topology (mapped once, no
network), or, after a topology change, by sending the boxes it wants and reading the staging
segment its agent gathered. ``steps`` applies the saved RNG states, resumes after the restored
step, and hands every finished step to the snapshot engine.

It is given what it uses (the epoch's assignment, the agent channel, the snapshot engine, the
process groups, and two callables of the runtime: ``check`` raises when the epoch has ended,
``staging`` waits for a gathered staging segment); it never reads the runtime's state.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import socket
import sys
import time
import types
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from peerckpt.errors import StateMismatch
from peerckpt.faults import NO_FAULTS, FaultHooks
from peerckpt.manifest import META_KEY, ChunkRecord
from peerckpt.messages.local import (
    Arrived,
    InexactState,
    RankResumed,
    ReleaseStaging,
    UnreshardableState,
    WantChunks,
)
from peerckpt.runtime import capture, loaders, twins
from peerckpt.runtime.audit import PREFIX, FirstStepWatch, covered_storages, warn_untracked
from peerckpt.runtime.carried import CARRIED, Carry
from peerckpt.runtime.held import held
from peerckpt.runtime.live import LiveState
from peerckpt.runtime.policy import Probe, RankReport, SnapshotPolicy
from peerckpt.runtime.reshardable import refusal, unreshardable
from peerckpt.runtime.restore import (
    ChunkSource,
    OldLayout,
    carried_values,
    read_meta,
    restore_objects,
    wanted_chunks,
)
from peerckpt.runtime.state import Assignment
from peerckpt.states import EpochMode

if TYPE_CHECKING:
    from peerckpt.runtime.channel import AgentChannel
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


@dataclass
class AuditOnce:
    """Whether this process still owes the audit of its loop (``runtime/audit.py``): it runs
    once per process, at the first step of the first epoch that tracks something."""

    pending: bool = True


class EpochTracking:
    """Restore and snapshot for one epoch of this process."""

    def __init__(
        self,
        assignment: Assignment,
        channel: AgentChannel,
        engine: SnapshotEngine,
        pg: ProcessGroupLifecycle,
        check: Callable[[], None],
        staging: Callable[[int, int], tuple[str, list[ChunkRecord]]],
        arrived: Callable[[int], Arrived],
        audit: AuditOnce,
        live: LiveState,
        policy: SnapshotPolicy,
        started_job: bool,
        faults: FaultHooks = NO_FAULTS,
    ) -> None:
        self.assignment = assignment
        self.channel, self.engine, self.pg = channel, engine, pg
        self.check = check  # raises MembershipChanged once the epoch has ended
        self._staging = staging  # (epoch, round) → the gathered segment's path and chunks
        self._arrived = arrived  # epoch → where the agent put a state it pulled meanwhile
        self._audit = audit
        self.live = live  # the process's live tensors: a survivor restores from them
        self.policy = policy  # when to snapshot, agreed once per job (runtime/policy.py)
        self._started_job = started_job  # a rank of the first epoch, not a spare
        self.faults = faults  # step points: a chaos step is a training step
        self._agent = _agent_clock(channel.agent_pid) if policy.fixed is None else None
        self.tracked: dict[str, Any] = {}
        self.step: int | None = None  # the step the loop is in (for log records, heartbeats)
        self.total: int | None = None  # the loop's total (``ctx.steps(total)``)
        self._restored: dict[str, Any] | None = None
        self._carried: dict[str, Any] | None = None  # what the restored step's loop carried
        self._positions: dict[int, int] = {}  # tracked loaders' restored positions, by id
        self._hooks: list[Any] = []
        self._resumed_sent = False
        self._round = 0
        self._watch: FirstStepWatch | None = None  # this epoch's first-step hooks
        self._looped = False  # this epoch's function has looped over ctx.steps

    def close(self) -> None:
        """The epoch is left: remove every hook it installed and let go of what the function
        tracked, so that the last epoch's model and optimizer are freed before the function
        builds the next epoch's (``step`` stays, for the heartbeats until then)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.tracked.clear()  # the dict the epoch's watch and audit hold too
        self._restored = self._carried = None
        self._looped = False
        if self._watch is not None:  # it holds the optimizers that stepped, the DDPs it saw
            self._watch.remove()
            self._watch = None

    def track(self, state: dict[str, Any]) -> None:
        clash = sorted(set(state) & set(self.tracked))
        if clash:
            raise StateMismatch(f"ctx.track got {clash} twice in one epoch; track each name once")
        if CARRIED in state:
            raise StateMismatch(f"ctx.track: {CARRIED!r} is the runtime's own name; pick another")
        for name, obj in state.items():
            refuse_unsupported(name, obj)
        self.check()
        if self._watch is None:
            self._start_watch()
        self.tracked.update(state)
        loaders.install(state)  # loader workers' RNG states travel in the loader's state
        for obj in state.values():
            if isinstance(obj, torch.optim.Optimizer):
                self._hooks.append(obj.register_step_pre_hook(self._before_optimizer_step))
        self._report_unreshardable(state)
        self._restore(state)
        for obj in state.values():  # where each loader was restored to (0 when fresh)
            if loaders.is_stateful_loader(obj):
                self._positions[id(obj)] = loaders.restored_position(obj)

    def _restore(self, state: dict[str, Any]) -> None:
        a = self.assignment
        if a.mode is EpochMode.RESHARD:
            self._restore_resharded(state)
            return
        if a.mode is EpochMode.SAME and a.arriving:
            a = self._await_state()
        if a.mode is not EpochMode.SAME or a.restore_slot is None:
            return
        cost = RestoreCost()
        slot = self.engine.slot_tensor(a.restore_slot)
        source = ChunkSource(a.chunks, slot=slot)
        meta = read_meta(slot, next(c for c in a.chunks if c.key == META_KEY))
        alive, clean = self.live.usable(a.rank, a.world_size, a.restore_step)
        adopted = restore_objects(
            state,
            self.tracked,
            source,
            {a.rank: meta},
            primary=a.rank,
            rank=a.rank,
            world_size=a.world_size,
            resharded=False,
            alive=alive,
            clean=clean,
        )
        self._watching().ddp.restore(meta.get("ddp", {}))
        self._restored = meta
        if self._carried is None:
            self._carried = carried_values(meta, source, a.rank)
        log.info(
            "restored %s from step %d in %s; %d bytes were still live (not copied), %d "
            "tensors of the old objects reused",
            sorted(state),
            meta["step"],
            cost.summary(),
            adopted,
            len(alive),
        )

    def _report_unreshardable(self, state: dict[str, Any]) -> None:
        """Name what cannot follow a change of world size (``runtime/reshardable.py``): rank 0
        tells the coordinator, which refuses an elastic start and nodes that join; a rank
        asked to reshard it refuses rather than load another rank's data position."""
        a = self.assignment
        if a.rank != 0 and a.mode is not EpochMode.RESHARD:
            return
        objects = unreshardable(state)
        if not objects:
            return
        if a.mode is EpochMode.RESHARD:
            raise StateMismatch(
                f"the world changed from {a.old_world} to {a.world_size} ranks, but "
                + refusal(objects)
            )
        self.channel.notify(UnreshardableState(a.epoch, a.rank, objects))

    def _await_state(self) -> Assignment:
        """Wait for the state the agent pulls while this process built its objects; from
        then on the epoch restores from (and snapshots beside) the slot it arrived in."""
        waited = time.perf_counter()
        got = self._arrived(self.assignment.epoch)
        self.assignment = self.assignment.arrived(got.slot, got.path, list(got.manifest.chunks))
        self.engine.restored_into(got.slot, got.path)
        log.info(
            "the state of step %s arrived %.3f s after the restore asked for it",
            self.assignment.restore_step,
            time.perf_counter() - waited,
        )
        return self.assignment

    def _restore_resharded(self, state: dict[str, Any]) -> None:
        """Restore ``state`` into this epoch's new layout: say which boxes this rank needs,
        wait for the agent to gather them (every rank of the epoch does the same, then the
        coordinator plans the reads of all of them at once), and load them."""
        a = self.assignment
        assert a.old_layout is not None
        old = OldLayout.from_msg(a.old_layout)
        primary = a.previous_rank if a.previous_rank is not None else a.rank % a.old_world
        wants = wanted_chunks(state, self.tracked, old, primary)
        round_ = self._round
        self._round += 1
        asked = time.perf_counter()
        self.channel.notify(WantChunks(a.epoch, a.rank, round_, [w.to_msg() for w in wants]))
        path, chunks = self._staging(a.epoch, round_)
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
        audit = self._audit.pending and (self.assignment.restore_step is None or self._started_job)
        self._watch = FirstStepWatch(self.tracked, audit=audit)
        self._hooks.append(self._watch)  # removed when the epoch is left, whatever happens

    def _watching(self) -> FirstStepWatch:
        assert self._watch is not None
        return self._watch

    def _before_optimizer_step(self, *args: Any) -> None:
        self.engine.guard_step()
        self.live.dirty()  # the step runs now: the live tensors leave the captured step

    def steps(self, total: int, made_in: list[types.FrameType] | None = None) -> Iterator[int]:
        """The loop's steps; ``made_in`` holds the frame that called ``ctx.steps`` (taken)."""
        asker = made_in.pop() if made_in else None
        if self._looped:
            # A second loop would number its steps again from 0: snapshots and commits of
            # steps already committed, and a restore could not say which loop to resume
            # (seen: the job hung at the second loop's step 2, nothing said).
            raise StateMismatch(
                f"ctx.steps({total}) is this function's second loop over ctx.steps: one loop "
                "per call of the decorated function, whose step numbers snapshots and restores "
                "count. Loop once over every step (epochs too: `for step in "
                "ctx.steps(epochs * per_epoch)`, with `epoch = step // per_epoch` and a new "
                "iterator at each epoch's first step), and branch on the step for phases"
            )
        self._looped = True
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
        carry = Carry.at_loop_start(made_in=asker) if self.tracked else None
        del asker  # the carry holds the loop's frame, until it is closed
        if carry is not None and carry.carries and self._carried:
            put = carry.put_back(self._carried, self.tracked)
            if put:
                log.info(
                    "%s put back as the loop carried %s into step %d",
                    ", ".join(f"`{n}`" for n in put),
                    "it" if len(put) == 1 else "them",
                    start,
                )
        self._carried = None
        covered = covered_storages(self.tracked) if carry is not None and carry.carries else set()
        self._resumed(start)
        watch = self._watch  # None when ctx.track was not called in this epoch
        if not self.tracked:
            warn_untracked()
        if watch is not None:
            watch.loop_started(self._positions)
        policy = self.policy
        policy.begin_epoch(start, (self._restored or {}).get("every"))
        self.total = total
        where = {"rank": a.rank, "node": a.node, "epoch": a.epoch, "total": total}
        try:
            for step in range(start, total):
                self.check()
                if self.faults.active:
                    self.faults.reach(step, check=self.check, **where)
                if policy.quiet_before(step) and self.engine.last_taken is not None:
                    # the plain steps about to be measured must not share the cores with the
                    # replication of the last one; the measured snapshot's work is done, and
                    # counted, once it is committed
                    self.engine.wait_committed(self.engine.last_taken, self.engine.commit_timeout_s)
                if policy.calibrating():
                    policy.probe(step, self._probe())
                if policy.ready(step):
                    self._agree_interval(step)
                self.step = step
                began = time.perf_counter()
                try:
                    yield step
                except GeneratorExit:
                    if self.faults.active and self._still_open():
                        self.faults.left(step, total)  # a break: no later step comes
                    raise
                self.check()
                # Nothing tracked: a snapshot would hold nothing a restore could use. The last
                # step is always taken: it is what the job ends with.
                if watch is not None and self.tracked and (policy.due(step) or step == total - 1):
                    extra: dict[str, Any] = {"ddp": watch.ddp.layouts()}
                    if policy.every is not None:
                        extra["every"] = policy.every
                    carried = (
                        carry.values(covered, self.tracked)
                        if carry is not None and carry.carries
                        else {}
                    )
                    captured = capture.capture(self.tracked, step, extra, carried)
                    if self.engine.dedup:
                        captured.twins = twins.declared_keys(self.tracked, watch.ddp.found())
                    self.live.captured(a.rank, a.world_size, step, captured)
                    self.engine.take(step, captured)
                    drift = carry.drifted() if carry is not None else []
                    for text in drift:
                        log.warning("%s%s", PREFIX, text)
                    if drift:  # the job's report says so too
                        self.channel.notify(InexactState(a.epoch, a.rank, drift))
                policy.record(step, time.perf_counter() - began)
                if step == start and watch is not None:
                    self._audit.pending = self._audit.pending and not watch.audit
                    # the first step is done: the hooks go, the audit speaks
                    iterators = carry.loader_iterators() if carry and watch.audit else []
                    unsaved = carry.unsaved(self.tracked) if carry and watch.audit else []
                    found = watch.finish(iterators, unsaved)
                    if found:  # the job's report says so too
                        self.channel.notify(InexactState(a.epoch, a.rank, found))
                if self.engine.committed_step is not None and self.engine.committed_step >= start:
                    self.pg.release_retired()  # this epoch committed: the old groups are idle
            if self.faults.active:
                # the last step's faults fire before the end
                self.faults.reach(total, check=self.check, **where)
        finally:
            self.step = None  # the loop is over: code after it has no live step
            if carry is not None:
                carry.close()  # it holds the loop's frame

    def _still_open(self) -> bool:
        """Whether this epoch goes on (a loop closed while it does was left by a break, not
        unwound by the epoch's end)."""
        try:
            self.check()
        except Exception:
            return False
        return True

    def _probe(self) -> Probe:
        """The calibration's counters now (``runtime/policy.py``)."""
        agent_cpu = 0.0
        if self._agent is not None:
            try:
                agent_cpu = time.clock_gettime(self._agent)
            except OSError:
                self._agent = None  # gone: its work goes uncounted
        return Probe(time.perf_counter(), time.process_time(), agent_cpu, self.engine.stall_s)

    def _agree_interval(self, step: int) -> None:
        """Choose the snapshot interval from every rank's measurement, the same on every
        rank: an all-gather, at the same step on every rank."""
        machine = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
        mine = RankReport(self.policy.measured(), machine, _cores(), self.assignment.node)
        rows = [torch.tensor(mine.row(), dtype=torch.float64)]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            rows = [torch.empty_like(rows[0]) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(rows, torch.tensor(mine.row(), dtype=torch.float64))
        reports = [RankReport.of_row(row.tolist()) for row in rows]
        self.policy.agree(reports, step, speak=self.assignment.rank == 0)

    def _resumed(self, start: int) -> None:
        if self._resumed_sent:
            return
        self._resumed_sent = True
        self.channel.notify(RankResumed(self.assignment.epoch, self.assignment.rank, start))


def _agent_clock(pid: int | None) -> int | None:
    """The CPU-time clock of the node agent (every thread of it), whose work the calibration
    reads; None where it cannot be read. Linux names another process's CPU clock
    ``(~pid << 3) | CPUCLOCK_SCHED`` (what glibc's ``clock_getcpuclockid`` returns): its
    nanoseconds, where ``/proc``'s counters tick every 10 ms — longer than an agent's work
    on a small snapshot."""
    if not pid or not sys.platform.startswith("linux"):
        return None
    clock = ctypes.c_int32((~pid << 3) | 2).value
    try:
        time.clock_gettime(clock)
    except OSError:
        return None
    return clock


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def refuse_unsupported(name: str, obj: Any) -> None:
    """StateMismatch for state a restore would silently get wrong, tracked itself or held by
    a tracked Stateful: an FSDP1 model (its state_dict() gives gathered copies, not its flat
    parameters: a restore wrote into the copies) and ZeroRedundancyOptimizer (its state is
    sharded over inner optimizers that its state_dict() gathers to one rank only)."""
    loader = getattr(sys.modules.get("torch.utils.data"), "DataLoader", None)
    if loader is not None and isinstance(obj, loader) and not hasattr(obj, "state_dict"):
        raise StateMismatch(
            f"ctx.track: {name} is a torch DataLoader, which keeps no position to restore "
            "(a new iterator starts its data epoch again): use torchdata's StatefulDataLoader "
            "instead (from torchdata.stateful_dataloader import StatefulDataLoader; the same "
            "arguments) and track that, or give the DataLoader a peerckpt.ResumableSampler and "
            "track the sampler"
        )
    fsdp1 = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    zero = getattr(sys.modules.get("torch.distributed.optim"), "ZeroRedundancyOptimizer", None)
    for path, held_obj in [(name, obj), *held({name: obj}).values()]:
        modules = held_obj.modules() if isinstance(held_obj, torch.nn.Module) else ()
        if fsdp1 is not None and any(isinstance(m, fsdp1) for m in modules):
            raise StateMismatch(
                f"ctx.track: {path} is (or holds) a FullyShardedDataParallel (FSDP1) model, "
                "which peerckpt cannot restore: its state_dict() gives gathered copies of its "
                "flat parameters, not the parameters; shard it with FSDP2 "
                "(torch.distributed.fsdp.fully_shard), which peerckpt snapshots and reshards, "
                "or train it under DDP"
            )
        if zero is not None and isinstance(held_obj, zero):
            raise StateMismatch(
                f"ctx.track: {path} is a ZeroRedundancyOptimizer, which peerckpt cannot "
                "restore: its state is sharded over inner optimizers and its state_dict() "
                "gathers it to one rank only; use the plain optimizer (peerckpt keeps one copy "
                "of data-parallel state per node pair: resilient(dedup=True)), or shard "
                "the model and its optimizer state with FSDP2"
            )
