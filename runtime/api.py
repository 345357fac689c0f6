"""The public API inside a training script: ``@peerckpt.resilient`` and ``Context``.

    @peerckpt.resilient()
    def train(ctx: peerckpt.Context) -> None:
        model = DDP(build_model())
        optim = torch.optim.AdamW(model.parameters())
        ctx.track(model=model, optim=optim, data=loader)   # restores here after a failure
        for step in ctx.steps(1000):                       # resumes after the restored step
            ...

The decorated function must be re-executable: after a failure the runtime calls it again in
the same process with a fresh ``Context`` for the new epoch.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from peerckpt.errors import PeerUnavailable
from peerckpt.runtime import children, standby
from peerckpt.runtime.config import DEFAULTS, ResilientConfig
from peerckpt.runtime.env import LaunchEnv, configure_logging
from peerckpt.runtime.rank import RankRuntime
from peerckpt.runtime.torchrun import join_host, under_torchrun
from peerckpt.runtime.tracking import EpochTracking
from peerckpt.states import ProcRole

F = TypeVar("F", bound=Callable[..., Any])


class Context:
    """What the decorated function gets: its place in the current epoch, and the state hooks."""

    def __init__(self, tracking: EpochTracking) -> None:
        self._tracking = tracking
        assignment = tracking.assignment
        self.rank = assignment.rank
        self.world_size = assignment.world_size
        self.local_rank = assignment.local_rank
        self.node = assignment.node
        self.epoch = assignment.epoch
        #: The step being executed (inside ``steps``), or the restored step before it.
        self.step: int | None = assignment.restore_step
        #: The committed step this epoch restored, or None on a fresh start.
        self.restored_step = assignment.restore_step

    def track(self, **state: Any) -> None:
        """Register training state; after a failure, restore it here from peer memory.

        Accepts ``nn.Module`` (also DDP-wrapped), ``torch.optim.Optimizer`` (its state is keyed
        by parameter name, so the model must be tracked too), tensors, and any object with
        ``state_dict()``/``load_state_dict()`` (LR schedulers, data loaders). RNG states of
        torch, random and numpy are tracked without being asked. Call it once per name,
        before ``steps``.
        """
        self._tracking.track(state)

    def steps(self, total: int) -> Iterator[int]:
        """Yield step numbers up to ``total - 1``, starting after the restored step.

        After an iteration the runtime snapshots the tracked state (in the background): every
        iteration, every n-th as ``resilient(every=n)`` fixes, or as the overhead budget chooses.
        """
        # The frame that asked for the steps is the one whose loop runs them, also where a
        # wrapper iterates them for it (``for step in tqdm(ctx.steps(n))``): its loop carries
        # the values a snapshot saves (runtime/carried.py). Held in a list the generator
        # empties, so that it does not keep that frame alive.
        return self._steps(total, [sys._getframe(1)])

    def _steps(self, total: int, made_in: list[types.FrameType]) -> Iterator[int]:
        for step in self._tracking.steps(total, made_in):
            self.step = step
            yield step


def resilient(
    fn: F | None = None,
    *,
    replicas: int | None = DEFAULTS.replicas,
    erasure: str | None = DEFAULTS.erasure,
    persist: str | None = DEFAULTS.persist,
    persist_every: int | None = DEFAULTS.persist_every,
    persist_interval: float | None = DEFAULTS.persist_interval,
    keep: int | None = DEFAULTS.keep,
    persist_allow_older: bool = DEFAULTS.persist_allow_older,
    persist_mode: int | None = DEFAULTS.persist_mode,
    pg_timeout_s: float = DEFAULTS.pg_timeout_s,
    backend: str | None = DEFAULTS.backend,
    suspect_s: float = DEFAULTS.suspect_s,
    abort_grace_s: float = DEFAULTS.abort_grace_s,
    abort_timeout_s: float = DEFAULTS.abort_timeout_s,
    every: int | None = DEFAULTS.every,
    overhead: float = DEFAULTS.overhead,
    mtbf: float | None = DEFAULTS.mtbf,
    max_lost: float = DEFAULTS.max_lost,
    dedup: bool = DEFAULTS.dedup,
) -> Any:
    """Make a training function survive the loss of ranks and nodes.

    ``replicas`` is how many buddies (on other nodes) mirror each rank's snapshot (default 1;
    ``peerckpt run --replicas K`` overrides it); ``erasure="K+M"`` keeps parity over groups of
    K+M nodes instead, any M of a group's nodes lost together rebuilt from the others, for M/K
    of a node's state (docs/erasure.md; the launcher's ``--replicas``/``--erasure`` override
    it). ``persist`` is a URL (a path, ``file://``,
    ``s3://``) where the agents write committed steps in the background, every
    ``persist_every`` steps (default 100) and/or ``persist_interval`` seconds, keeping the
    newest ``keep`` (``peerckpt run --persist`` overrides it). A job started again finds the
    latest committed step there and restores it; with ``persist_allow_older`` it verifies it
    first and falls back to older steps if it is damaged. ``persist_mode`` is the permission
    bits of the files written to local storage (default ``0o600``, directories ``0o700``).
    ``backend`` is what each epoch's
    process group is initialised with (as in ``init_process_group``; default
    ``"cpu:gloo,cuda:nccl"`` where CUDA is available, else ``"gloo"``; ``"gloo"`` lets several
    ranks share one GPU). ``pg_timeout_s`` is the process groups'
    timeout (a failure is normally acted on long before it); ``suspect_s`` is how long a rank
    whose collective failed waits for the coordinator's verdict before treating the error as
    its own. A rank told to abort that has not left the epoch after ``abort_grace_s`` cuts
    all its connections to the job's hosts; after ``abort_timeout_s`` more it exits and a
    fresh process on its node takes its place, restored from the node's memory (three times
    in a row at most; then it is a lost rank). Spares are set on the launcher
    (``peerckpt run --spares S``).

    Snapshots: ``every=n`` takes one after every n-th step. Otherwise the runtime measures
    over its first 25 steps the work a snapshot costs here (CPU seconds of the rank and its
    node's agent over five snapshots, against a training step's), and snapshots every n
    steps with n the smallest that keeps that below ``overhead`` (a fraction of the step
    time, default 0.05), rounded to the nearest power of two; given
    ``mtbf`` (the mean time between failures, seconds) it snapshots less often where the
    Young/Daly interval sqrt(2 · cost · mtbf) is longer. Either way n steps never take more
    than ``max_lost`` seconds (default 5.0): the most training a failure may lose, which wins
    over the budget. The choice, the expected work lost per failure and any rank whose
    measurement stood out are logged once, by rank 0 (``runtime/policy.py``).

    ``dedup`` (default True): parameters and optimizer state that a DDP over the whole world
    keeps equal on every rank are not mirrored to buddies where the data-parallel twins
    already hold them in enough nodes (verified by checksum at every commit);
    ``dedup=False`` mirrors every rank's whole snapshot.
    """

    config = ResilientConfig(
        replicas=replicas,
        erasure=erasure,
        persist=persist,
        persist_every=persist_every,
        persist_interval=persist_interval,
        keep=keep,
        persist_allow_older=persist_allow_older,
        persist_mode=persist_mode,
        pg_timeout_s=pg_timeout_s,
        backend=backend,
        suspect_s=suspect_s,
        abort_grace_s=abort_grace_s,
        abort_timeout_s=abort_timeout_s,
        every=every,
        overhead=overhead,
        mtbf=mtbf,
        max_lost=max_lost,
        dedup=dedup,
    )
    config.persist_msg()  # a bad persist setting fails here, at decoration time

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            configure_logging()
            runtime = standby.take(config)  # a spare that waited for its rank at the import
            if runtime is None:
                runtime = _start(config)
            return runtime.run(func, args, kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


def _start(config: ResilientConfig) -> RankRuntime:
    """This process's runtime, created at the function's call (a rank of the first epoch;
    under torchrun, any worker)."""
    if under_torchrun():
        join_host()  # this host's agent, started by its first worker
    env = LaunchEnv.from_environ()
    try:
        runtime = RankRuntime(env, config)
    except PeerUnavailable as exc:
        if env.role is ProcRole.RANK:
            raise
        # A spare or joining process whose node agent is gone (the job ended, or the node
        # was lost) has nothing to stand by for.
        logging.getLogger("peerckpt.rank").info("%s exits: %s", env.role.value, exc)
        raise SystemExit(0) from None
    children.install(runtime.channel.conn.sock)  # DataLoader workers die with us
    return runtime
