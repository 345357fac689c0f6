"""The job's status page (``/status`` beside ``/metrics``): one small HTML document that
reloads itself, rendered from a :class:`~peerckpt.launch.view.JobView`.

No script, no external asset: a browser (or ``curl``) gets everything in one response, and
every value from the job is escaped. Tables carry ids (``summary``, ``nodes``, ``ranks``,
``recoveries``) and every cell of a node or rank row a ``data-field`` name, so that a test
or a scraper can read them without depending on the layout.
"""

from __future__ import annotations

import html
import time

from peerckpt.launch.view import JobView, RecoveryView
from peerckpt.states import JobState
from peerckpt.units import human

REFRESH_S = 2

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .3em; } h2 { font-size: 1.05em; margin: 1.2em 0 .3em; }
table { border-collapse: collapse; } td, th { padding: .2em .7em; text-align: left; }
th { background: #eee; } tr:nth-child(even) td { background: #f7f7f7; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
.ok { color: #1a7f37; } .bad { color: #c62828; font-weight: bold; } .muted { color: #777; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _s(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.0f} ms"


def _step(step: int | None) -> str:
    return "–" if step is None else str(step)


def _row(cells: list[tuple[str, str, str]]) -> str:
    """A table row of (field name, css class, already escaped text) cells."""
    return (
        "<tr>"
        + "".join(f'<td data-field="{f}" class="{c}">{t}</td>' for f, c, t in cells)
        + "</tr>"
    )


def _recovery_row(r: RecoveryView) -> list[tuple[str, str, str]]:
    if r.resumed_at is None:
        outcome = "repairing"
        if r.superseded:  # repaired with a newer failure: its cost runs to that repair's end
            outcome = f"superseded, {_s(r.total_s)}" if r.total_s is not None else "superseded"
    else:
        outcome = _s(r.total_s)
    where = ", ".join(f"rank {k} (node {v})" for k, v in sorted(r.lost.items()))
    moved = f"{human(r.network_bytes)} over TCP" if r.network_bytes else ""
    if r.storage_bytes:
        moved += (", " if moved else "") + f"{human(r.storage_bytes)} from storage"
    return [
        ("at", "", _e(time.strftime("%H:%M:%S", time.localtime(r.detected_at)))),
        ("kind", "", _e(r.kind)),
        ("cause", "", _e(r.cause)),
        ("lost", "", _e(where or "–")),
        ("detection", "num", _s(r.detection_s)),
        ("transfer", "num", _s(r.transfer_s)),
        ("restore", "num", _s(r.restore_s)),
        ("total", "num", _e(outcome)),
        ("restore_step", "num", _step(r.restore_step)),
        ("moved", "", _e(moved or "local memory only")),
    ]


def render(view: JobView, metrics_path: str = "/metrics") -> str:
    """The status page of ``view``."""
    state = view.state
    state_class = (
        "bad" if state is JobState.FAILED else "ok" if state is not JobState.STOPPED else ""
    )
    summary = [
        ("state", f'<span class="{state_class}">{_e(state.value)}</span>'),
        ("epoch", _e(view.epoch)),
        ("world size", _e(view.world_size)),
        ("committed step", _step(view.committed_step)),
        ("durable step", _step(view.durable_step)),
        ("replication lag", "–" if view.lag is None else f"{view.lag} step(s)"),
        ("spares", _e(view.spares)),
        ("recovering", "yes" if view.recovering else "no"),
        (
            "recoveries",
            _e(", ".join(f"{k.value} {n}" for k, n in view.recoveries_total.items())),
        ),
    ]
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="refresh" content="{REFRESH_S}">',
        f"<title>peerckpt · {_e(view.job)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>peerckpt job <code>{_e(view.job)}</code></h1>",
        f'<p class="muted">refreshes every {REFRESH_S} s · '
        f'<a href="{_e(metrics_path)}">metrics</a> · <a href="/status.json">json</a></p>',
    ]
    if view.reason:
        out.append(f'<p class="bad">{_e(view.reason)}</p>')
    out.append('<table id="summary">')
    out += [f'<tr><th>{k}</th><td data-field="{_e(k)}">{v}</td></tr>' for k, v in summary]
    out.append("</table>")

    out.append('<h2>Nodes</h2><table id="nodes"><tr>')
    out.append(
        "<th>node</th><th>health</th><th>ranks</th><th>slots</th><th>replicas</th>"
        "<th>snapshots</th><th>replicated</th></tr>"
    )
    for n in view.nodes:
        health = ("alive" if n.alive else "lost") + (" (spare node)" if n.spare else "")
        out.append(
            _row(
                [
                    ("node", "num", _e(n.node)),
                    ("health", "ok" if n.alive else "bad", _e(health)),
                    ("ranks", "", _e(", ".join(map(str, n.ranks)) or "–")),
                    ("slots", "num", _e(human(n.memory.get("slots", 0)))),
                    ("replicas", "num", _e(human(n.memory.get("replicas", 0)))),
                    ("snapshots", "num", _e(n.snapshots)),
                    ("replicated", "num", _e(human(n.replicated_bytes))),
                ]
            )
        )
    out.append("</table>")

    out.append('<h2>Ranks</h2><table id="ranks"><tr>')
    out.append(
        "<th>rank</th><th>node</th><th>pid</th><th>copies on nodes</th><th>buddies</th>"
        "<th>snapshot step</th><th>lag</th></tr>"
    )
    for r in view.ranks:
        copies = ", ".join("storage" if c < 0 else str(c) for c in r.copies) or "–"
        out.append(
            _row(
                [
                    ("rank", "num", _e(r.rank)),
                    ("node", "num", _e(r.node)),
                    ("pid", "num", _e(r.pid)),
                    ("copies", "", _e(copies)),
                    ("buddies", "", _e(", ".join(map(str, r.buddies)) or "–")),
                    ("snapshot_step", "num", _step(r.snapshot_step)),
                    ("lag", "num", _step(r.lag)),
                ]
            )
        )
    out.append("</table>")

    out.append('<h2>Last recoveries</h2><table id="recoveries"><tr>')
    out.append(
        "<th>detected</th><th>kind</th><th>cause</th><th>lost</th><th>detection</th>"
        "<th>transfer</th><th>restore</th><th>total</th><th>restored step</th><th>moved</th></tr>"
    )
    for rec in reversed(view.recoveries):
        out.append(_row(_recovery_row(rec)))
    if not view.recoveries:
        out.append('<tr><td colspan="10" class="muted">none yet</td></tr>')
    out.append("</table></body></html>")
    return "\n".join(out)
