"""``Launcher.run``, the one sequence every backend follows: its steps in order, ``stop``
whatever happened, a chaos action that never fired failing a job that succeeded, the
report written."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from peerckpt.errors import PeerckptError
from peerckpt.launch.base import JobOutcome, JobResult, JobSpec, Launcher


class _Chaos:
    fired: list[dict[str, object]] = []

    def __init__(self, calls: list[str], unfired: list[str]) -> None:
        self.calls, self._unfired = calls, unfired

    def start(self, launcher: object, rpc: object, fault_dir: str | None) -> None:
        self.calls.append("chaos.start")

    def stop(self) -> None:
        self.calls.append("chaos.stop")

    def unfired(self) -> list[str]:
        return list(self._unfired)


class _Recording(Launcher):
    """A backend that records which step ``run`` called; ``fail_in`` raises there."""

    def __init__(self, spec: JobSpec, fail_in: str = "", unfired: list[str] | None = None) -> None:
        self.job, self.run_id, self.spec = "j", "r", spec
        self.calls: list[str] = []
        self.fail_in = fail_in
        self.chaos = _Chaos(self.calls, unfired or [])  # type: ignore[assignment]
        self.rpc = object()  # type: ignore[assignment]
        self._fault_dir = None
        self._interrupted = threading.Event()

    def _step(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail_in:
            raise PeerckptError(f"{name} failed")

    def _prepare(self) -> None:
        self._step("prepare")

    def start(self) -> None:
        self._step("start")

    def _watch(self) -> tuple[JobOutcome, str]:
        self._step("watch")
        return JobOutcome.SUCCEEDED, ""

    def _wind_down(self) -> None:
        self._step("wind_down")

    def stop(self) -> None:
        self.calls.append("stop")

    def _result(self, outcome: JobOutcome, reason: str, wall_s: float) -> JobResult:
        self.calls.append("result")
        return JobResult(self.job, outcome.exit_code, outcome, reason, [], [], wall_s)

    def kill_node(self, node: int) -> None: ...

    def kill_agent(self, node: int) -> None: ...

    def kill_coordinator(self) -> None: ...

    def add_node(self) -> int:
        return 0


def test_run_calls_every_step_in_order_and_writes_the_report(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    launcher = _Recording(JobSpec("train.py", report=str(report)))
    result = launcher.run()
    assert launcher.calls == [
        "prepare",
        "start",
        "chaos.start",
        "watch",
        "chaos.stop",
        "wind_down",
        "stop",
        "result",
    ]
    assert result.state is JobOutcome.SUCCEEDED and result.exit_code == 0
    assert json.loads(report.read_text())["state"] == "succeeded"


def test_a_failed_start_still_stops_everything_and_fails_the_job() -> None:
    launcher = _Recording(JobSpec("train.py"), fail_in="start")
    result = launcher.run()
    assert launcher.calls == ["prepare", "start", "chaos.stop", "wind_down", "stop", "result"]
    assert result.state is JobOutcome.FAILED and result.reason == "start failed"
    assert result.exit_code == 1


def test_an_action_that_never_fired_fails_a_job_that_succeeded() -> None:
    line = "chaos action 'kill rank=1 at=99' never fired: the job ended at step 20"
    result = _Recording(JobSpec("train.py"), unfired=[line]).run()
    assert result.state is JobOutcome.FAILED and result.exit_code == 1
    assert result.unfired == [line] and line in result.reason
