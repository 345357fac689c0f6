"""``peerckpt timeline REPORT.json -o run.png``: a picture of a run and of what every failure
cost.

The data comes from the job's report (``peerckpt run --report``): the launcher's samples of
every rank's replicated step, the committed step and the epochs over wall-clock time
(``monitor.JobMonitor``), the coordinator's failure events, the chaos records and the durable
flushes. ``timeline_data`` turns them into the drawn data, times in seconds since the job
started, with every fault of the run (also those that lost nothing, such as a slow link);
``draw`` makes the picture with matplotlib:

- top: each rank's step over time, the committed step, every fault (a red line, its number),
  the time until every rank stepped again shaded, and durable flushes (purple ticks);
- bottom: per fault, its cost in milliseconds, split into detection, transfer and restore
  (``view.py`` defines the phases).

No I/O but the files named; the picture is drawn without a display (the Agg backend).
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

from peerckpt.errors import ConfigurationError, ProtocolError
from peerckpt.launch.base import JobResult
from peerckpt.launch.report import causes
from peerckpt.launch.view import recovery_views
from peerckpt.outfiles import write_private

WIDTH_IN, HEIGHT_IN, DPI = 12.0, 8.0, 100  # 1200 × 800 pixels
PHASE_COLORS = {"detection": "#f28e2b", "transfer": "#4e79a7", "restore": "#59a14f"}


def load_report(path: str) -> JobResult:
    """A job report written by ``peerckpt run --report``, decoded once."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(
            f"cannot read the job report {path!r}: {exc}; write one with "
            "`peerckpt run --report PATH …`"
        ) from exc
    if not isinstance(report, dict) or "events" not in report:
        raise ConfigurationError(
            f"{path!r} is not a job report (no 'events'); write one with "
            "`peerckpt run --report PATH …`"
        )
    try:
        return JobResult.from_json(report)
    except (ProtocolError, KeyError, TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"{path!r} is not a job report ({type(exc).__name__}: {exc}); write one with "
            "`peerckpt run --report PATH …`"
        ) from exc


def timeline_data(report: JobResult) -> dict[str, Any]:
    """What the picture shows, JSON-ready, times in seconds since the job started."""
    samples = report.timeline
    events, chaos = report.events, report.chaos
    starts = [samples.get("started_at")] + [e.detected_at for e in events]
    starts += [c.fired_at for c in chaos if c.fired_at]
    known = [t for t in starts if t is not None]
    t0 = samples.get("started_at") or (min(known) if known else 0.0)

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 4)

    ranks: dict[str, list[list[Any]]] = {}
    for t, rank, step in samples.get("steps", []):
        ranks.setdefault(str(int(rank)), []).append([rel(t), step])
    faults: list[dict[str, Any]] = []
    for number, r in enumerate(recovery_views(events, chaos), 1):
        faults.append(
            {
                "number": number,
                "cause": r.cause,
                "kind": r.kind.value,
                "injected": r.fault_at is not None,
                "fault_s": rel(r.fault_at if r.fault_at is not None else r.detected_at),
                "detected_s": rel(r.detected_at),
                "resumed_s": rel(r.resumed_at),
                "detection_s": r.detection_s,
                "transfer_s": r.transfer_s,
                "restore_s": r.restore_s,
                "total_s": r.total_s,
                "restore_step": r.restore_step,
                "lost": {str(k): v for k, v in r.lost.items()},
                "superseded": r.superseded,
            }
        )
    # Faults that lost nothing (a slow link, a corrupt replica, a short partition) have no
    # failure event; they are faults of the run all the same.
    paired = {id(c) for c in causes(events, chaos) if c is not None}
    for c in chaos:
        if c.fired_at and id(c) not in paired:
            faults.append(
                {
                    "number": len(faults) + 1,
                    "cause": c.action,
                    "kind": "no loss",
                    "injected": True,
                    "fault_s": rel(c.fired_at),
                    "detected_s": None,
                    "resumed_s": None,
                    "detection_s": None,
                    "transfer_s": None,
                    "restore_s": None,
                    "total_s": None,
                    "restore_step": None,
                    "lost": {},
                    "superseded": False,
                }
            )
    faults.sort(key=lambda f: f["fault_s"])
    for number, f in enumerate(faults, 1):
        f["number"] = number
    return {
        "job": report.job,
        "state": report.state.value,
        "wall_s": report.wall_s,
        "started_at": t0,
        "ranks": ranks,
        "committed": [[rel(t), s] for t, s in samples.get("commits", [])],
        "epochs": [[rel(t), e, w] for t, e, w in samples.get("epochs", [])],
        "faults": faults,
        "skipped": [c.action for c in chaos if not c.fired_at],
        "flushes": [
            {
                "step": f.step,
                "state": f.state.value,
                "start_s": rel(f.started_at),
                "end_s": rel(f.committed_at),
            }
            for f in report.flushes
        ],
    }


def _short(text: str, n: int = 48) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def draw(data: dict[str, Any], path: str) -> None:
    """Write the picture of ``data`` (``timeline_data``) to ``path`` (PNG, 1200 × 800)."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    faults = data["faults"]
    fig, (top, bottom) = plt.subplots(
        2,
        1,
        figsize=(WIDTH_IN, HEIGHT_IN),
        dpi=DPI,
        gridspec_kw={"height_ratios": [3, min(2.5, 0.6 + 0.2 * len(faults))]},
    )
    many = len(data["ranks"]) > 12
    for rank, points in sorted(data["ranks"].items(), key=lambda kv: int(kv[0])):
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        if many:
            top.step(xs, ys, where="post", color="0.6", linewidth=0.6)
        else:
            top.step(xs, ys, where="post", linewidth=1.2, label=f"rank {rank}")
    if data["committed"]:
        xs, ys = [p[0] for p in data["committed"]], [p[1] for p in data["committed"]]
        top.step(
            xs, ys, where="post", color="black", linestyle="--", linewidth=1, label="committed"
        )
    for f in faults:
        top.axvline(f["fault_s"], color="#d62728", linewidth=1)
        if f["resumed_s"] is not None:
            top.axvspan(f["fault_s"], f["resumed_s"], color="#d62728", alpha=0.15, linewidth=0)
        top.annotate(
            f"#{f['number']}",
            (f["fault_s"], 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, -12),
            textcoords="offset points",
            color="#d62728",
            fontsize=9,
        )
    durable = [f for f in data["flushes"] if f["state"] == "committed" and f["end_s"] is not None]
    if durable:
        top.plot(
            [f["end_s"] for f in durable],
            [f["step"] for f in durable],
            "v",
            color="#9467bd",
            label="durable flush",
        )
    top.set_xlim(left=0)  # the start-up shows too: processes, rendezvous, the first step
    top.set_xlabel("seconds since the job started")
    top.set_ylabel("step (replicated)")
    total = f" in {data['wall_s']:.1f} s" if data.get("wall_s") else ""
    top.set_title(f"job {data['job']}: {data['state']}{total}, {len(faults)} fault(s)", loc="left")
    if not many and (data["ranks"] or data["committed"]):
        top.legend(loc="lower right", fontsize=8, ncol=2)
    top.grid(alpha=0.3)
    _costs(bottom, faults)
    fig.tight_layout()
    picture = io.BytesIO()
    fig.savefig(picture, dpi=DPI, format=os.path.splitext(path)[1].lstrip(".") or "png")
    plt.close(fig)
    write_private(path, picture.getvalue())


def _costs(ax: Any, faults: list[dict[str, Any]]) -> None:
    """Per fault, a bar of its cost in ms, one segment per phase."""
    if not faults:
        ax.text(0.5, 0.5, "no faults", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    labels = []
    for i, f in enumerate(faults):
        left = 0.0
        for phase, color in PHASE_COLORS.items():
            seconds = f[f"{phase}_s"]
            if seconds:
                ax.barh(i, seconds * 1000, left=left, color=color, height=0.6)
                left += seconds * 1000
        if f["superseded"]:
            note = "repaired with the next"
        elif f["kind"] == "no loss":
            note = "nothing lost"
        elif f["resumed_s"] is None:
            note = "NOT RECOVERED"
        else:
            parts = [f"{(f[p + '_s'] or 0) * 1000:.0f}" for p in PHASE_COLORS]
            note = f"{f['total_s'] * 1000:.0f} ms ({' + '.join(parts)})"
        ax.annotate(
            note, (left, i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8
        )
        labels.append(f"#{f['number']} {_short(f['cause'])} ({f['kind']})")
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=p) for p, c in PHASE_COLORS.items()]
    ax.legend(
        handles=handles,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    ax.set_yticks(range(len(faults)), labels, fontsize=8)
    ax.set_ylim(len(faults) - 0.5, -0.5)  # the first fault on top
    ax.set_xlim(0, ax.get_xlim()[1] * 1.2)  # room for the notes
    ax.set_xlabel("cost of each fault, ms (detection: injected faults only)")
    ax.grid(axis="x", alpha=0.3)


def timeline(report_path: str, out: str, data_out: str | None = None) -> dict[str, Any]:
    """Draw the report at ``report_path`` to ``out``; with ``data_out`` also write the drawn
    data as JSON. Returns the data."""
    data = timeline_data(load_report(report_path))
    draw(data, out)
    if data_out:
        write_private(data_out, json.dumps(data, indent=1))
    return data
