"""``peerckpt status``: a running job in the terminal.

It asks the job's coordinator for its ``Status`` (found by job name through the job file
that ``peerckpt run`` wrote, as ``peerckpt join`` does, or at ``--rdzv-endpoint HOST:PORT``
with the job's secret from ``PEERCKPT_SECRET`` or a 0600 ``--secret-file``), builds the
:class:`~peerckpt.launch.view.JobView` every observer shows, and draws it with ``rich``: a
live view that redraws every ``--interval`` seconds until the job ends or Ctrl-C, one
snapshot as text (``--once``), or as JSON (``--json``).

It only reads: ``Status`` changes nothing in the job.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from peerckpt.errors import ConfigurationError, PeerckptError
from peerckpt.launch.jobfile import find_job
from peerckpt.launch.view import JobView, RecoveryView, build_view
from peerckpt.messages.control import Status
from peerckpt.rpc import RpcClient
from peerckpt.secret import job_secret
from peerckpt.states import JobState
from peerckpt.units import human


def connect(job: str, endpoint: str | None, secret_file: str | None) -> RpcClient:
    """A client of the coordinator of ``job``: at ``endpoint``, else found on this machine."""
    if endpoint:
        return RpcClient(endpoint, job_secret(secret_file), job)
    info = find_job(job)
    return RpcClient(info["coordinator"], bytes.fromhex(info["secret"]), job)


def fetch(rpc: RpcClient) -> JobView:
    return build_view(rpc.call(Status(), timeout=5.0))


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.0f} ms"


def _opt(value: int | None) -> str:
    return "–" if value is None else str(value)


def _recovery_cells(r: RecoveryView) -> list[str]:
    if r.resumed_at is None:
        total = "[red]repairing[/]"
        if r.superseded:  # repaired with a newer failure: its cost runs to that repair's end
            total = f"superseded, {_ms(r.total_s)}" if r.total_s is not None else "superseded"
    else:
        total = _ms(r.total_s)
    moved = []
    if r.network_bytes:
        moved.append(f"{human(r.network_bytes)} TCP")
    if r.storage_bytes:
        moved.append(f"{human(r.storage_bytes)} storage")
    return [
        time.strftime("%H:%M:%S", time.localtime(r.detected_at)),
        r.kind.value,
        r.cause,
        ", ".join(f"{k}@n{v}" for k, v in sorted(r.lost.items())) or "–",
        _ms(r.detection_s),
        _ms(r.transfer_s),
        _ms(r.restore_s),
        total,
        _opt(r.restore_step),
        ", ".join(moved) or "local",
    ]


def render(view: JobView) -> Group:
    """The job as rich tables: summary, nodes, ranks, last recoveries."""
    color = {JobState.RUNNING: "green", JobState.FAILED: "red", JobState.SUCCEEDED: "cyan"}.get(
        view.state, "yellow"
    )
    head = Text.from_markup(
        f"job [bold]{view.job}[/] [{color}]{view.state.value}[/] · epoch {view.epoch} · "
        f"world {view.world_size} · committed step {_opt(view.committed_step)} · "
        f"durable step {_opt(view.durable_step)} · lag {_opt(view.lag)} · "
        f"spares {view.spares}" + (" · [red]recovering[/]" if view.recovering else "")
    )
    totals = ", ".join(f"{k.value} {n}" for k, n in view.recoveries_total.items())
    lines: list[Any] = [head, Text(f"recoveries: {totals}")]
    if view.reason:
        lines.append(Text(view.reason, style="red"))
    nodes = Table(title="nodes", title_justify="left")
    for col in ("node", "health", "ranks", "slots", "replicas", "snapshots", "replicated"):
        nodes.add_column(col, justify="right" if col not in ("health", "ranks") else "left")
    for n in view.nodes:
        health = "[green]alive[/]" if n.alive else "[red]lost[/]"
        nodes.add_row(
            str(n.node),
            health + (" (spare node)" if n.spare else ""),
            ", ".join(map(str, n.ranks)) or "–",
            human(n.memory.get("slots", 0)),
            human(n.memory.get("replicas", 0)),
            str(n.snapshots),
            human(n.replicated_bytes),
        )
    ranks = Table(title="ranks", title_justify="left")
    for col in ("rank", "node", "pid", "copies on nodes", "buddies", "newest step", "lag"):
        ranks.add_column(
            col, justify="right" if col not in ("copies on nodes", "buddies") else "left"
        )
    for r in view.ranks:
        copies = ", ".join("storage" if c < 0 else str(c) for c in r.copies) or "–"
        ranks.add_row(
            str(r.rank),
            str(r.node),
            str(r.pid),
            copies,
            ", ".join(map(str, r.buddies)) or "–",
            _opt(r.snapshot_step),
            _opt(r.lag),
        )
    recs = Table(title="last recoveries", title_justify="left")
    for col in (
        "detected",
        "kind",
        "cause",
        "lost",
        "detection",
        "transfer",
        "restore",
        "total",
        "restored step",
        "moved",
    ):
        recs.add_column(col)
    for rec in reversed(view.recoveries):
        recs.add_row(*_recovery_cells(rec))
    return Group(*lines, nodes, ranks, recs)


def status(
    job: str,
    endpoint: str | None = None,
    secret_file: str | None = None,
    once: bool = False,
    as_json: bool = False,
    interval: float = 1.0,
    out: TextIO | None = None,
) -> int:
    """``peerckpt status``: 0 once shown (or the job ended while watched)."""
    out = out if out is not None else sys.stdout
    rpc = connect(job, endpoint, secret_file)
    try:
        try:
            view = fetch(rpc)
        except PeerckptError as exc:
            raise ConfigurationError(
                f"cannot reach the coordinator of job {job!r}: {exc}; is the job still running?"
            ) from exc
        if as_json:
            out.write(json.dumps(view.to_json(), indent=1) + "\n")
            return 0
        terminal = out.isatty()
        console = Console(file=out, width=None if terminal else 140)
        if once or not terminal:
            console.print(render(view))
            return 0
        with Live(render(view), console=console, refresh_per_second=4) as live:
            while not view.state.ended:
                time.sleep(interval)
                try:
                    view = fetch(rpc)
                except PeerckptError:
                    live.update(Group(render(view), Text("the coordinator is gone: job over")))
                    break
                live.update(render(view))
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        rpc.close()
