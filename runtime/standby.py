"""A spare's wait for its rank, before the script's own top level runs.

A script reads its rank where torchrun taught it to: from ``RANK``, ``LOCAL_RANK`` and
``WORLD_SIZE`` at its top level (nanoGPT's ``train.py``: ``ddp = int(os.environ.get('RANK',
-1)) != -1``, then the DDP wrapping, ``seed_offset``, ``gradient_accumulation_steps //=
world_size``). A spare, a process restarted in place, and a joiner do not know their rank
when they start: it is assigned by a recovery. Run as before, their top level saw no
``RANK`` and built another job (no DDP: the restore then failed on the module's names, or
the run was not exact).

So at ``import peerckpt`` (``peerckpt/__init__.py``; the prefork server's forked spares from
``launch/prefork.py``) such a process becomes the job's process at once (``RankRuntime``,
with the default settings: the decorator's are taken when the function is called), warms up,
says hello as a spare, and waits there for an assignment. Once one comes it sets the
variables of the rank it takes and returns: the script's top level then runs as that rank's
would, and the decorated function joins the epoch (``take``). A spare that is never needed
exits at the import with status 0, and nothing of the script below it runs.

What the top level does after ``import peerckpt`` now counts in the recovery's time: keep it
light (docs/failure-model.md). The main process only: a DataLoader worker started by spawn,
which imports the script's modules again, never waits here.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from peerckpt import exitnote
from peerckpt.errors import ConfigurationError, PeerUnavailable
from peerckpt.runtime import children, userpg
from peerckpt.runtime.config import DEFAULTS, ResilientConfig
from peerckpt.runtime.env import LaunchEnv, configure_logging
from peerckpt.runtime.rank import JobEnded, RankRuntime
from peerckpt.states import ProcRole

log = logging.getLogger("peerckpt.rank")
_waiting: RankRuntime | None = None  # the runtime that waited at the import, until ``take``


def on_import() -> None:
    """In a job's training process, at ``import peerckpt``: a script's own top-level
    ``init_process_group`` does nothing from here on, and a spare, a restarted or a joining
    process waits here for its rank (the module docstring)."""
    global _waiting
    userpg.install_early()
    if _waiting is not None or multiprocessing.parent_process() is not None:
        return
    if os.environ.get("PEERCKPT_AGENT"):  # an uncaught exception is named by the launcher
        exitnote.install(os.path.dirname(os.environ["PEERCKPT_AGENT"]))
    role = os.environ.get("PEERCKPT_ROLE")
    if role not in (ProcRole.SPARE.value, ProcRole.JOINER.value):
        return
    if not os.path.exists(os.environ.get("PEERCKPT_AGENT", "")):
        return  # no agent to wait with: the decorated function says so when it is called
    try:
        env = LaunchEnv.from_environ()
    except ConfigurationError:
        return  # not a process a launcher started (no secret): the decorator says so
    configure_logging()
    try:
        runtime = RankRuntime(env, DEFAULTS)
    except PeerUnavailable as exc:
        # Its node's agent is gone (the job ended, or the node was lost): nothing to wait for.
        log.info("%s exits: %s", env.role.value, exc)
        raise SystemExit(0) from None
    children.install(runtime.channel.conn.sock)  # DataLoader workers die with us
    try:
        assignment = runtime.await_assignment()
    except JobEnded:
        runtime.close()
        raise SystemExit(0) from None  # a spare that was never needed: nothing of the script runs
    os.environ.update(
        RANK=str(assignment.rank),
        LOCAL_RANK=str(assignment.local_rank),
        WORLD_SIZE=str(assignment.world_size),
        # what the script's own subprocesses inherit: they are not spares waiting for a rank
        PEERCKPT_ROLE=ProcRole.RANK.value,
    )
    log.info(
        "%s takes rank %d of %d (epoch %d); the script runs from here",
        env.role.value,
        assignment.rank,
        assignment.world_size,
        assignment.epoch,
    )
    _waiting = runtime


def take(config: ResilientConfig) -> RankRuntime | None:
    """The runtime that waited at the import, now with the decorator's settings; None in a
    process that did not wait (a rank of the job's first epoch)."""
    global _waiting
    runtime, _waiting = _waiting, None
    if runtime is not None:
        runtime.configure(config)
    return runtime
