"""``peerckpt join``: add one node to a job that is already running on this machine.

It finds the job by name (the job file its ``peerckpt run`` published, private to the user
who started it and checked as such: ``launch/jobfile.py``), gets a node index from the
coordinator, starts an agent and
``--nproc-per-node`` processes of the job's script, and waits. Once all of them are
connected, the coordinator widens the world and every rank restores the last committed step
into the new layout. ``peerckpt join`` then stays until the job ends, and stops what it
started on the way out — also on Ctrl-C.

A job that tracks a data loader that cannot reshard refuses the node (``NotReshardable``,
``recovery/unreshardable.py``): before anything starts, or, when rank 0 named that loader
only after the node was given its index, once its processes connected; ``peerckpt join``
then exits non-zero with the reason, and the job goes on as it was.
"""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import threading

from peerckpt.errors import PeerckptError
from peerckpt.launch.checks import check_env, check_join
from peerckpt.launch.jobfile import find_job
from peerckpt.launch.processes import ProcessSet
from peerckpt.messages.control import AllocateNode, Status
from peerckpt.rpc import RpcClient
from peerckpt.shm import sweep
from peerckpt.states import ExitCode, JobState, ProcRole

log = logging.getLogger("peerckpt.launcher")
__all__ = ["find_job", "join"]


def join(
    job: str,
    nproc_per_node: int | None = None,
    script: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Join ``job`` with one node; return the job's exit status once it ends. Its processes
    get the job's ``--env`` and then ``env`` (``join --env``)."""
    check_join(nproc_per_node, script)
    check_env(env or {})
    info = find_job(job)
    secret = bytes.fromhex(info["secret"])
    count = nproc_per_node or info["nproc_per_node"]
    rpc = RpcClient(info["coordinator"], secret, job)
    node = rpc.call(AllocateNode()).node
    rundir = tempfile.mkdtemp(prefix=f"peerckpt-{job}-join{node}-")
    extra_env = {**info.get("env", {}), **(env or {})}
    procs = ProcessSet(job, secret, script or info["script"], rundir, extra_env, info["run"])
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    state = "failed"
    try:
        agent = procs.start_agent(node, info["coordinator"], ["--joining", str(count)])
        procs.await_ready(agent.agent, f"agent of node {node}")
        for _ in range(count):
            procs.start_proc(node, ProcRole.JOINER)
        log.info("node %d joins job %s with %d rank(s)", node, job, count)
        while not stop.wait(0.2):
            try:
                status = rpc.call(Status(), timeout=5.0)
            except PeerckptError:
                state = "failed"  # the coordinator is gone: the job is over
                break
            state = status.state.value
            if node in status.refused_joins:  # the job is not harmed: only this node goes
                log.error("node %d was refused: %s", node, status.refused_joins[node])
                state = "failed"
                break
            if state in ("succeeded", "failed", "stopped") or agent.agent.poll() is not None:
                break
            if state == JobState.RUNNING.value:
                procs.restart_stuck()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        procs.stop()
        rpc.close()
        sweep(job, info["run"], node)
        shutil.rmtree(rundir, ignore_errors=True)
    if stop.is_set():
        return ExitCode.INTERRUPTED
    return ExitCode.OK if state == JobState.SUCCEEDED.value else ExitCode.FAILED
