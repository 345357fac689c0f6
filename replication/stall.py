"""A rank alive but not stepping: named with its stack, and fenced where the job asked for it.

A rank's heartbeats come from a thread of their own, so a rank whose training thread is stuck
outside any collective keeps beating: a DataLoader whose worker died or deadlocked (its
``next()`` waits), a read of a hung network file system, a deadlock in the script's own code.
Its peers wait for it in their next collective. Nothing failed, so nothing was detected: the
job sat there until the process group's timeout (30 minutes by default) and ended then with
an error about a collective, far from the cause.

Each agent watches the live step of its ranks (the step each heartbeat carries). A rank whose
step has not moved for ``warn_after`` (at least ``STALL_WARN_MIN_S``, and ``STALL_STEPS``
times its usual step time) is named in a warning, with what it is doing: waiting in a
collective (its peers are the ones behind), computing (its main thread uses a CPU), or
neither (stuck: the rank to look at); and its Python stacks are written to its output
(``faulthandler`` on ``STACK_SIGNAL``, registered by the rank). The warning comes again
every ``AGAIN_S`` while the stall lasts.

With ``peerckpt run --stall-timeout S`` a rank stuck for ``S`` seconds (neither waiting in a
collective peerckpt watches or in the runtime itself, ``runtime/waits.py``, nor computing) is
fenced like a hung process: the job recovers it from its peers' memory. Not before its CPU
share is known over at least ``MIN_WINDOW_S`` (one look says nothing of it), and, until the
rank has finished a step in its loop, not before ``STALL_WARN_MIN_S`` (a first step pays for a
compile, the workers' start, a restored loader catching up). Off by default: a step that
legitimately waits outside a collective (an evaluation that reads from a slow store) must not
be cut short by a guess. A rank that
waits in a collective peerckpt does not watch (NCCL's, a collective started with
``async_op=True``) counts as stuck there, so a stall fences its peers too, and the whole job
is restored from its last committed step.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from peerckpt.replication.busy import BUSY_SHARE

STALL_WARN_MIN_S = 120.0  # a stall shorter than this is never named (a slow step, an eval)
STALL_STEPS = 30  # ... nor one shorter than this many usual steps
AGAIN_S = 600.0  # a stall that lasts is named again this often
CPU_WINDOW_S = 30.0  # a stalled rank's CPU share is judged over its last this many seconds
MIN_WINDOW_S = 1.0  # ... and never over less
_INTERVALS = 32  # recent step times kept per rank


@dataclass
class _Live:
    rank: int
    step: int
    since: float  # when this step was first seen
    intervals: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=_INTERVALS)
    )
    named_at: float | None = None  # when this stall was last named
    fenced: bool = False
    cpu: collections.deque[tuple[float, float]] = field(  # (main thread's CPU seconds, when)
        default_factory=collections.deque
    )

    def usual(self) -> float | None:
        """Its usual step time: the median of its recent steps, if it finished any."""
        return statistics.median(self.intervals) if self.intervals else None


@dataclass(frozen=True)
class Stalled:
    """One rank whose step has not moved: what the agent says and does about it."""

    pid: int
    rank: int
    step: int
    stalled_s: float
    step_s: float | None  # its usual step time (median of its recent steps), if known
    waiting: bool  # inside a collective peerckpt watches: its peers are behind
    cpu_share: float | None  # its main thread's share of a core over the last window
    fence: bool  # stuck past --stall-timeout: the agent fences it

    def doing(self) -> str:
        if self.waiting:
            return "waits in a collective (a peer is behind)"
        if self.cpu_share is not None:
            return f"computes ({self.cpu_share * 100:.0f}% of a core)"
        return (
            "is in no collective and uses no CPU: stuck in the script's own code "
            "(a DataLoader that never delivers, a hung read, a deadlock)"
        )

    def line(self) -> str:
        usual = f", a step usually takes {self.step_s:.2g} s" if self.step_s is not None else ""
        return (
            f"rank {self.rank} (pid {self.pid}) has been at step {self.step} for "
            f"{self.stalled_s:.0f} s{usual}; it {self.doing()}"
        )


class StallWatch:
    """The live steps of an agent's ranks, and which of them stalled (see the module's doc)."""

    def __init__(
        self,
        cpu_seconds: Callable[[int], float | None],
        fence_after_s: float | None = None,
        warn_min_s: float = STALL_WARN_MIN_S,
        steps: int = STALL_STEPS,
    ) -> None:
        """``cpu_seconds(pid)``: the CPU time of its main thread, None if stopped or gone."""
        self.cpu_seconds = cpu_seconds
        self.fence_after_s = fence_after_s
        self.warn_min_s = warn_min_s
        self.steps = steps
        self._live: dict[int, _Live] = {}

    def observe(self, now: float, beats: Iterable[tuple[int, int | None, int | None]]) -> None:
        """``beats``: (pid, rank, step) of each local process's last heartbeat."""
        seen = set()
        for pid, rank, step in beats:
            if rank is None or step is None:
                continue  # outside its loop: restoring, setting up, done
            seen.add(pid)
            live = self._live.get(pid)
            if live is None or live.rank != rank or step < live.step:
                self._live[pid] = _Live(rank, step, now)  # new, or a restore went back
            elif step > live.step:
                live.intervals.append((now - live.since) / (step - live.step))
                live.step, live.since, live.named_at, live.fenced = step, now, None, False
                live.cpu.clear()
        for pid in set(self._live) - seen:
            del self._live[pid]

    def warn_after(self, pid: int) -> float:
        """How long ``pid``'s step may stay before the stall is named."""
        return max(self.warn_min_s, self.steps * (self._live[pid].usual() or 0.0))

    def fence_after(self, pid: int) -> float | None:
        """How long ``pid``'s step may stay before a stuck rank is fenced: ``fence_after_s``,
        but never less than the naming floor before the rank has finished a step in this
        loop (its first step pays what no later one does: a compile, the workers' start, a
        restored loader's catching up)."""
        if self.fence_after_s is None:
            return None
        if self._live[pid].usual() is None:
            return max(self.fence_after_s, self.warn_min_s)
        return self.fence_after_s

    def _sample(self, pid: int, live: _Live, now: float) -> None:
        """Note ``pid``'s main thread's CPU time now; keep the newest sample at least
        ``CPU_WINDOW_S`` old, and those after it."""
        cpu = self.cpu_seconds(pid)
        if cpu is None:
            live.cpu.clear()  # stopped or gone: nothing to judge a share over
            return
        live.cpu.append((cpu, now))
        while len(live.cpu) > 2 and now - live.cpu[1][1] >= CPU_WINDOW_S:
            live.cpu.popleft()

    def _cpu_share(self, live: _Live, now: float) -> tuple[bool, float | None]:
        """(known, share): whether the share of a core ``pid``'s main thread used over about
        the last ``CPU_WINDOW_S`` (at least ``MIN_WINDOW_S``) is known, and that share if it
        computes (at least ``BUSY_SHARE``), else None."""
        if len(live.cpu) < 2:
            return False, None
        (first, then), (last, at) = live.cpu[0], live.cpu[-1]
        if at - then < MIN_WINDOW_S:
            return False, None
        share = (last - first) / (at - then)
        return True, share if share >= BUSY_SHARE else None

    def look(self, now: float) -> None:
        """Sample the CPU time of each rank stalled for a third of its shortest threshold,
        so that its share is known, over a window, by the time it is judged."""
        for pid, live in self._live.items():
            soonest = min(self.warn_after(pid), self.fence_after(pid) or float("inf"))
            if now - live.since >= soonest / 3:
                self._sample(pid, live, now)

    def due(self, now: float, waiting: Callable[[int], bool]) -> list[Stalled]:
        """The stalls to name or fence now; each is named once per ``AGAIN_S`` and fenced
        once. ``waiting(pid)``: inside a collective peerckpt watches."""
        self.look(now)
        out = []
        for pid, live in self._live.items():
            stalled_s = now - live.since
            fence_after = self.fence_after(pid)
            fence = fence_after is not None and stalled_s >= fence_after and not live.fenced
            name = stalled_s >= self.warn_after(pid) and (
                live.named_at is None or now - live.named_at >= AGAIN_S
            )
            if not (fence or name):
                continue
            is_waiting, (known, share) = waiting(pid), self._cpu_share(live, now)
            # never fenced on a share not yet known: it may compute
            fence = fence and known and not is_waiting and share is None
            if not (fence or name):
                continue  # past --stall-timeout, but waiting or computing: named on time
            live.named_at = now
            live.fenced = live.fenced or fence
            out.append(
                Stalled(
                    pid, live.rank, live.step, stalled_s, live.usual(), is_waiting, share, fence
                )
            )
        return out
