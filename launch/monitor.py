"""What a launcher keeps about its running job for observers, and the HTTP endpoint that
serves it (``peerckpt run --metrics-port PORT``).

``JobMonitor`` is fed every ``Status`` the launcher polls (with the failure events of the
whole job and the chaos records); it keeps the newest view, the last report of every node
(a restarted coordinator forgets lost nodes), every failure event any coordinator of the job
reported (``remember``: a restarted coordinator knows only its own, and the launcher hands
over whatever events it saw, from any status it got, however stale), the steps committed over
the job (the end-of-run summary), and the samples a timeline picture is drawn from: each
rank's newest replicated step, the committed step and the epoch over wall-clock time. ``MonitorServer`` serves ``/metrics`` (Prometheus text), ``/status`` (an HTML page that
reloads itself) and ``/status.json``, on loopback unless told otherwise, on a server that
strangers cannot starve (``launch/httpserve.py``).

Neither ever talks to the job: they only read what the launcher's watch loop hands them, so
a slow scraper cannot slow the job down.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from peerckpt.chaos import FiredAction
from peerckpt.errors import ConfigurationError
from peerckpt.launch import metrics, statuspage
from peerckpt.launch.httpserve import DEFAULT_LIMITS, BoundedHTTPServer, HttpLimits, host_allowed
from peerckpt.launch.report import summarize
from peerckpt.launch.view import JobView, build_view
from peerckpt.messages.control import FlushRecord, JobStatus, NodeStats, RecoveryEvent

log = logging.getLogger("peerckpt.launcher")
MAX_STEP_SAMPLES = 200_000  # a timeline of a very long job keeps its first this many points


class JobMonitor:
    """The newest view of a job and its timeline samples; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._view: JobView | None = None
        self._node_stats: dict[int, NodeStats] = {}
        self.started_at = time.time()
        self._steps: list[list[float]] = []  # [t, rank, step]
        self._commits: list[list[float]] = []  # [t, step]
        self._epochs: list[list[float]] = []  # [t, epoch, world size]
        self._last: dict[int, int] = {}
        self._full_logged = False
        # Steps committed: a restarted coordinator counts from 0 again, the job does not.
        self._commits_before = self._commits_now = 0
        # Every failure of the job, by its identity, in the order first seen; each the newest
        # version reported (an event is replaced as its recovery goes on, never mutated).
        self._events: dict[tuple[str, int, float], RecoveryEvent] = {}
        self._flushes: list[FlushRecord] = []
        self._inexact: list[str] = []  # the ranks' audit findings (``JobStatus.inexact``)

    def observe(
        self, status: JobStatus, events: list[RecoveryEvent], chaos: list[FiredAction]
    ) -> JobView:
        """Take one ``Status`` reply; return the job's view now."""
        now = time.time()
        with self._lock:
            self._node_stats.update(status.node_stats)
            commits = status.commits
            if commits < self._commits_now:
                self._commits_before += self._commits_now
            self._commits_now = commits
            events = self._remember(events)
            self._flushes = list(status.flushes)
            # a restarted coordinator knows only what the ranks said since: keep every line
            self._inexact += [line for line in status.inexact if line not in self._inexact]
            view = build_view(status, events, chaos, dict(self._node_stats))
            self._view = view
            self._sample(now, status, view)
            return view

    def remember(self, events: list[RecoveryEvent]) -> list[RecoveryEvent]:
        """Keep ``events`` (newer versions replace older ones of the same failure); return
        every failure of the job seen so far, oldest first. Nothing is ever dropped: a list
        from a coordinator that was since restarted, or from a stale status, only adds."""
        with self._lock:
            return self._remember(events)

    def events(self) -> list[RecoveryEvent]:
        """Every failure of the job seen so far, oldest first."""
        with self._lock:
            return list(self._events.values())

    def _remember(self, events: list[RecoveryEvent]) -> list[RecoveryEvent]:
        for event in events:
            key = (event.kind.value, event.from_epoch, event.detected_at)
            old = self._events.get(key)
            if old is None or _progress(event) >= _progress(old):
                self._events[key] = event
        return list(self._events.values())

    def _sample(self, now: float, status: JobStatus, view: JobView) -> None:
        if view.committed_step is not None and (
            not self._commits or self._commits[-1][1] != view.committed_step
        ):
            self._commits.append([now, view.committed_step])
        if view.epoch >= 0 and (not self._epochs or self._epochs[-1][1] != view.epoch):
            self._epochs.append([now, view.epoch, view.world_size])
        for rank, step in status.last_replicated.items():
            if self._last.get(rank) == step:
                continue
            self._last[rank] = step
            if len(self._steps) < MAX_STEP_SAMPLES:
                self._steps.append([now, rank, step])
            elif not self._full_logged:
                self._full_logged = True
                log.info("timeline: %d step samples kept; later ones dropped", MAX_STEP_SAMPLES)

    def view(self) -> JobView | None:
        with self._lock:
            return self._view

    def summary(self) -> dict[str, Any]:
        """The end-of-run summary's figures (``report.summarize``), as of the last status."""
        with self._lock:
            view = self._view
            return summarize(
                self._commits_before + self._commits_now,
                view.committed_step if view is not None else None,
                sum(s.snapshots for s in self._node_stats.values()),
                list(self._events.values()),
                self._flushes,
                list(self._inexact),
            )

    def timeline(self) -> dict[str, Any]:
        """The samples for ``peerckpt timeline`` (the report's ``timeline``)."""
        with self._lock:
            return {
                "started_at": self.started_at,
                "steps": list(self._steps),
                "commits": list(self._commits),
                "epochs": list(self._epochs),
            }


def _progress(event: RecoveryEvent) -> tuple[bool, int, int, int]:
    """How far ``event``'s recovery had got when reported, so that a stale copy of a failure
    (from a status polled before the newest one) never replaces a newer one: resumed or not,
    the epoch it opened (a survivor restarted in place opens another), its restarts in place,
    then its restores (which such a restart starts again from none)."""
    return (
        event.resumed_at is not None,
        -1 if event.epoch is None else event.epoch,
        len(event.restarted) + len(event.in_place),
        len(event.pulls),
    )


class MonitorServer:
    """``/metrics``, ``/status`` and ``/status.json`` of one job over HTTP. ``start`` it;
    ``stop`` always (it joins its thread)."""

    def __init__(
        self,
        monitor: JobMonitor,
        addr: str = "127.0.0.1",
        port: int = 0,
        limits: HttpLimits = DEFAULT_LIMITS,
    ) -> None:
        self.monitor = monitor
        registry = metrics.registry(monitor.view)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server calls it by this name
                server = self.server
                assert isinstance(server, BoundedHTTPServer)
                server.request_read(self.request)
                if not host_allowed(self):
                    self._send(421, "text/plain; charset=utf-8", b"not this server's name\n")
                    return
                path = self.path.split("?", 1)[0]
                if path == "/":
                    self.send_response(302)
                    self.send_header("Location", "/status")
                    self.end_headers()
                    return
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                    return
                view = monitor.view()
                if path in ("/status", "/status.json") and view is None:
                    self._send(503, "text/plain; charset=utf-8", b"the job is starting\n")
                elif path == "/status" and view is not None:
                    page = statuspage.render(view).encode()
                    self._send(200, "text/html; charset=utf-8", page)
                elif path == "/status.json" and view is not None:
                    body = json.dumps(view.to_json(), indent=1).encode()
                    self._send(200, "application/json", body)
                else:
                    self._send(404, "text/plain; charset=utf-8", b"try /metrics or /status\n")

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("metrics: " + format, *args)

        try:
            self._server = BoundedHTTPServer((addr, port), Handler, limits)
        except (OSError, OverflowError) as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {addr}:{port}: {exc}; pick a free --metrics-port "
                "(0 picks one) or another --metrics-addr"
            ) from exc
        self.address = f"{addr}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="peerckpt-metrics", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        log.info(
            "metrics at http://%s/metrics, status page at http://%s/status",
            self.address,
            self.address,
        )

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5.0)
        self._server.server_close()
