"""The snapshot copy engine: captured state → the rank's free slot, in the background.

Each rank has two slots (ping-pong). The slot holding the last committed step is never
written; a snapshot goes to the other one, and only once the previous snapshot has been
committed, so at most one snapshot per rank is in flight. The copy runs on a named thread
(torch's copy releases the GIL); the training loop blocks only in ``guard_step``, which the
runtime calls from an optimizer step pre-hook (the optimizer must not change state that is
still being copied), and in ``wait_copy`` before the next snapshot.

On a GPU the copy runs on a side CUDA stream into the slot registered as pinned memory
(``runtime/cuda_copy.py``), and the optimizer step waits for it on the GPU, not in Python.

When the copy is done the engine tells the agent, which checksums and replicates the slot.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from peerckpt.errors import CommitTimeout, MembershipChanged
from peerckpt.faults import NO_FAULTS, FaultHooks
from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.messages.local import AllocSlot, SlotGranted, SnapshotTaken
from peerckpt.runtime import cuda_copy, waits
from peerckpt.runtime.capture import Captured, layout, write_slot
from peerckpt.runtime.channel import AgentChannel
from peerckpt.runtime.twins import twin_indices
from peerckpt.shm import map_segment

log = logging.getLogger("peerckpt.snapshot")


class MappedSlot:
    """A slot segment mapped into this process, as a uint8 tensor (no copy)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mm = map_segment(path)
        self.size = len(self._mm)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = False

    def pin(self) -> None:
        """Register the mapping with CUDA once, before the first device-to-host copy."""
        if not self.pinned:
            self.pinned = cuda_copy.pin(self.tensor)

    def close(self) -> None:
        if self.pinned:
            cuda_copy.unpin(self.tensor)
            self.pinned = False
        del self.tensor
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it


@dataclass
class _Job:
    epoch: int
    step: int
    captured: Captured
    ready: cuda_copy.Events  # per CUDA device: the training stream's point of the snapshot


class SnapshotEngine:
    """Owns the rank's mapped slots and the copy thread."""

    def __init__(
        self,
        channel: AgentChannel,
        commit_timeout_s: float = 300.0,
        node: int = -1,
        faults: FaultHooks = NO_FAULTS,
        dedup: bool = True,
    ) -> None:
        self._channel = channel
        self._node = node
        self._faults = faults
        self.commit_timeout_s = commit_timeout_s
        # Declare data-parallel chunks to the agent (``resilient(dedup=…)``, runtime/twins.py).
        self.dedup = dedup
        self._twins_for: tuple[Any, ...] | None = None
        self._twin_list: list[int] = []
        self.last_taken: int | None = None  # the last step handed to ``take`` in this epoch
        self._cond = threading.Condition()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._slots: dict[int, MappedSlot] = {}
        self._layout_key: tuple[object, ...] | None = None
        self._layout: tuple[list[ChunkRecord], int] | None = None
        self.epoch = -1
        self.rank = -1
        self.committed_index: int | None = None
        self.committed_step: int | None = None
        self._awaiting: tuple[int, int] | None = None  # (slot, step) written, not committed
        self._blocked_on: int | None = None  # the step whose commit the copy thread awaits
        self._busy = False
        self._copies_queued: cuda_copy.Events | None = None  # the job's device copies, queued
        self._side = cuda_copy.SideStreams()
        self._aborted = False
        self._error: BaseException | None = None
        self.stall_s = 0.0
        self._thread = threading.Thread(
            target=self._run, name="peerckpt-snapshot-copy", daemon=True
        )
        self._thread.start()

    # -- epochs ---------------------------------------------------------------------------
    def begin_epoch(
        self,
        epoch: int,
        rank: int,
        committed_index: int | None,
        committed_step: int | None,
        committed_path: str | None,
    ) -> None:
        with self._cond:
            while self._busy:
                self._cond.wait(0.1)
            self.epoch, self.rank = epoch, rank
            self.committed_index, self.committed_step = committed_index, committed_step
            self._awaiting, self._aborted, self._error = None, False, None
            self.last_taken = None
            if committed_index is not None and committed_path is not None:
                current = self._slots.get(committed_index)
                if current is None or current.path != committed_path:
                    self._remap(committed_index, committed_path)
            elif committed_index is None:
                # Fresh start: the agent may have dropped our slots; ask again on first use.
                for index in list(self._slots):
                    self._slots.pop(index).close()

    def restored_into(self, index: int, path: str) -> None:
        """The epoch's committed snapshot arrived after ``begin_epoch``, in own slot ``index``
        at ``path``: the next snapshot goes into the other slot."""
        with self._cond:
            self.committed_index = index
            current = self._slots.get(index)
            if current is None or current.path != path:
                self._remap(index, path)

    @property
    def blocked_on_commit(self) -> int | None:
        """The step whose commit the copy thread is waiting for before it may write the next
        snapshot (None when it is not waiting)."""
        with self._cond:
            return self._blocked_on

    def slot_tensor(self, index: int) -> torch.Tensor:
        return self._slots[index].tensor

    def abort(self) -> None:
        """The epoch ended: drop queued work and wake every waiter."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def on_commit(self, epoch: int, step: int) -> None:
        with self._cond:
            if epoch == self.epoch and self._awaiting is not None and self._awaiting[1] == step:
                self.committed_index, self.committed_step = self._awaiting
                self._awaiting = None
                self._cond.notify_all()

    # -- the training loop's side ---------------------------------------------------------
    def take(self, step: int, captured: Captured) -> None:
        """Queue a snapshot of ``step``; returns at once unless the previous copy still runs."""
        self.wait_copy()
        ready = cuda_copy.record_ready([t.tensor for t in captured.tensors])
        with self._cond:
            self._busy = True
            self.last_taken = step
        self._queue.put(_Job(self.epoch, step, captured, ready))

    def guard_step(self) -> None:
        """Called before ``optimizer.step()``: the step must not change state still being
        copied. CPU state: wait for the copy. CUDA state: once the copies are queued on the
        side streams, the training streams wait for them on the GPU and Python goes on."""
        with self._cond:
            if not self._busy:
                self._raise_pending()
                return
            start = time.perf_counter()
            with waits.waiting():
                while self._busy and self._copies_queued is None and not self._aborted:
                    self._cond.wait()
            if self._busy and self._copies_queued is not None:
                cuda_copy.wait_on_training_streams(self._copies_queued)
            self.stall_s += time.perf_counter() - start
            self._raise_pending()

    def wait_copy(self) -> None:
        """Block until no copy is in flight. Raise if the epoch ended or the copy failed."""
        with self._cond:
            if self._busy:
                start = time.perf_counter()
                with waits.waiting():
                    while self._busy and not self._aborted:
                        self._cond.wait()
                self.stall_s += time.perf_counter() - start
            self._raise_pending()

    def wait_committed(self, step: int, timeout: float) -> bool:
        """Wait until ``step`` (or a later one) is committed."""
        deadline = time.monotonic() + timeout
        with self._cond, waits.waiting():
            while self.committed_step is None or self.committed_step < step:
                self._raise_pending()
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._aborted:
            raise MembershipChanged(f"epoch {self.epoch} ended")

    def close(self) -> None:
        self.abort()
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        for slot in self._slots.values():
            slot.close()
        self._slots.clear()

    # -- the copy thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except MembershipChanged:
                pass
            except BaseException as exc:  # handed to the training loop at its next wait
                log.exception("snapshot of step %d failed", job.step)
                with self._cond:
                    self._error = exc
            finally:
                with self._cond:
                    self._busy = False
                    self._copies_queued = None
                    self._cond.notify_all()

    def _write(self, job: _Job) -> None:
        deadline = time.monotonic() + self.commit_timeout_s
        with self._cond:
            try:
                while self._awaiting is not None and not self._aborted and job.epoch == self.epoch:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CommitTimeout(
                            f"step {self._awaiting[1]} was not committed within "
                            f"{self.commit_timeout_s:g} s, so step {job.step} cannot be "
                            "snapshotted without overwriting the last committed copy; "
                            "replication is stuck (see the agents' and the coordinator's logs)"
                        )
                    self._blocked_on = self._awaiting[1]
                    self._cond.wait(left)
            finally:
                self._blocked_on = None
            if self._aborted or job.epoch != self.epoch:
                raise MembershipChanged("epoch ended before the snapshot could be written")
            target = 0 if self.committed_index is None else 1 - self.committed_index
        chunks, used = self._chunks(job.captured)
        slot = self._ensure_slot(target, used)
        if job.ready:
            slot.pin()
        midway = None
        if self._faults.active:
            where = {"rank": self.rank, "node": self._node, "step": job.step}
            midway = functools.partial(self._faults.strike, "snapshot", **where)
        with self._side.copying(job.ready) as done:
            write_slot(slot.tensor, chunks, job.captured, bool(job.ready), midway)
        if done:
            with self._cond:
                self._copies_queued = done
                self._cond.notify_all()
            for event in done.values():
                event.synchronize()
        manifest = SnapshotManifest(
            self.rank, job.step, job.epoch, tuple(chunks), used, extra=self._twins(job.captured)
        )
        with self._cond:
            if self._aborted or job.epoch != self.epoch:
                raise MembershipChanged("epoch ended during the snapshot copy")
            self._awaiting = (target, job.step)
        self._channel.notify(SnapshotTaken(job.epoch, self.rank, job.step, target, manifest))

    def _twins(self, captured: Captured) -> dict[str, Any]:
        """The manifest's declaration of the chunks every data-parallel rank holds equal."""
        if not captured.twins or self._layout is None:
            return {}
        if self._twins_for != (self._layout_key, captured.twins):
            self._twins_for = (self._layout_key, captured.twins)
            self._twin_list = twin_indices(self._layout[0], captured.twins)
        return {"twins": self._twin_list} if self._twin_list else {}

    def _chunks(self, captured: Captured) -> tuple[list[ChunkRecord], int]:
        key = (
            *(
                (t.key, t.tensor.dtype, tuple(t.tensor.shape), t.global_shape, t.offsets, t.scope)
                for t in captured.tensors
            ),
            len(captured.blob),
        )
        if key != self._layout_key:
            self._layout = layout(captured.tensors, len(captured.blob))
            self._layout_key = key
        assert self._layout is not None
        return self._layout

    def _ensure_slot(self, index: int, used: int) -> MappedSlot:
        slot = self._slots.get(index)
        if slot is None or slot.size < used:
            capacity = used + (64 << 10) + used // 64
            granted = self._channel.request(
                AllocSlot(self.epoch, self.rank, index, capacity), SlotGranted
            )
            slot = self._remap(index, granted.path)
        return slot

    def _remap(self, index: int, path: str) -> MappedSlot:
        old = self._slots.pop(index, None)
        if old is not None:
            old.close()
        slot = MappedSlot(path)
        self._slots[index] = slot
        return slot
