"""The chaos monkey against a stand-in job: when an action's step comes, what it fires, what
it says of an action that never fired, and when it lets the ranks held at a step go on."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from peerckpt.chaos.monkey import ChaosMonkey
from peerckpt.chaos.spec import parse_chaos
from peerckpt.messages.control import JobStatus, NodeStats, Status
from peerckpt.states import JobState


class FakeJob:
    """A status source the test moves by hand: committed step, live steps, ranks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.committed: int | None = None
        self.live: dict[int, int] = {}
        self.total: int | None = None
        self.ranks: dict[int, list[int]] = {0: [0, 100], 1: [0, 101]}
        self.refused_joins: dict[int, str] = {}

    def call(self, msg: Status, timeout: float = 10.0) -> JobStatus:
        with self.lock:
            stats = NodeStats(0, 0, 0, {}, {}, live_step=dict(self.live), steps_total=self.total)
            return JobStatus(
                job="j",
                state=JobState.RUNNING,
                reason="",
                epoch=0,
                world_size=2,
                min_nodes=None,
                committed_step=self.committed,
                last_replicated={},
                ranks={r: list(v) for r, v in self.ranks.items()},
                spares=[],
                nodes={0: True},
                events=[],
                flushes=[],
                flush_skipped=[],
                node_stats={0: stats},
                refused_joins=dict(self.refused_joins),
            )


class FakeTarget:
    def __init__(self, directory: str | None) -> None:
        self.killed: list[int] = []
        self.directory = directory

    @property
    def chaos_dir(self) -> str | None:
        return self.directory

    def kill_pid(self, pid: int) -> None:
        self.killed.append(pid)

    def add_node(self) -> int:
        self.killed.append(1000)  # "node added", in the order of what was done
        return 2

    def corrupt_replicas(self, rank: int) -> list[str]:
        self.killed.append(-rank)  # in the order of what was done
        return [f"n0-r{rank}-g1"]


def _wait(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def test_an_action_fires_when_a_rank_reaches_its_step_though_nothing_was_committed(
    tmp_path,
) -> None:
    job, target = FakeJob(), FakeTarget(str(tmp_path))
    monkey = ChaosMonkey(parse_chaos("kill rank=1 at=15"), job, target)  # type: ignore[arg-type]
    monkey.start()
    try:
        time.sleep(0.1)
        assert target.killed == [] and not (tmp_path / "released-15").exists()
        (tmp_path / "reached-15").write_text(json.dumps({"rank": 0, "step": 15}))
        assert _wait(lambda: target.killed == [101])
        assert _wait(lambda: (tmp_path / "released-15").exists())  # the held ranks go on
        [record] = monkey.fired
        assert record.step == 15 and record.committed_step is None
    finally:
        monkey.stop()
    assert monkey.unfired() == []


def test_without_step_points_the_live_step_of_the_heartbeats_brings_the_step(tmp_path) -> None:
    job, target = FakeJob(), FakeTarget(None)  # the Ray driver: no fault directory of its own
    monkey = ChaosMonkey(parse_chaos("kill rank=0 at=7"), job, target)  # type: ignore[arg-type]
    monkey.start()
    try:
        with job.lock:
            job.live = {0: 6, 1: 6}
        time.sleep(0.1)
        assert target.killed == []
        with job.lock:
            job.live = {0: 7, 1: 6}
        assert _wait(lambda: target.killed == [100])
    finally:
        monkey.stop()


def test_an_action_whose_step_never_came_is_named_with_where_the_job_ended(tmp_path) -> None:
    job, target = FakeJob(), FakeTarget(str(tmp_path))
    actions = parse_chaos("kill rank=1 at=40; kill rank=0 at=3")  # fired in step order
    monkey = ChaosMonkey(actions, job, target)  # type: ignore[arg-type]
    monkey.start()
    (tmp_path / "reached-3").write_text("{}")
    assert _wait(lambda: target.killed == [100])
    (tmp_path / "ended.json").write_text(json.dumps({"step": 29}))
    monkey.stop()
    assert (tmp_path / "released-40").exists()  # a stopped monkey holds no rank back
    assert monkey.unfired() == [
        "chaos action 'kill rank=1 at=40' never fired: the job ended at step 29, never "
        "reaching step 40"
    ]


def test_a_loop_left_by_a_break_is_named_also_once_the_jobs_folder_is_gone(tmp_path) -> None:
    """Early stopping: the ranks left their loop after step 14 of 200 (``ChaosHooks.left``).
    The launcher removes the job's folder before it asks which actions never fired: what the
    ranks wrote there is read when the monkey stops (before, a real run named the last
    committed step, "got to step 13", never the end)."""
    import shutil

    from peerckpt.chaos.points import ChaosHooks

    folder = tmp_path / "faults"
    folder.mkdir()
    job, target = FakeJob(), FakeTarget(str(folder))
    monkey = ChaosMonkey(parse_chaos("kill rank=1 at=20"), job, target)  # type: ignore[arg-type]
    monkey.start()
    ChaosHooks(str(folder), 0, False).left(14, 200)
    monkey.stop()
    shutil.rmtree(folder)
    assert monkey.unfired() == [
        "chaos action 'kill rank=1 at=20' never fired: the job left its loop after step 14 "
        "(a break), never reaching step 20"
    ]


def test_a_step_past_the_loop_is_refused_as_soon_as_the_loop_is_known(tmp_path) -> None:
    job, target = FakeJob(), FakeTarget(str(tmp_path))
    monkey = ChaosMonkey(parse_chaos("kill rank=1 at=500"), job, target)  # type: ignore[arg-type]
    monkey.start()
    try:
        time.sleep(0.1)
        assert monkey.refusal is None
        (tmp_path / "loop.json").write_text(json.dumps({"total": 30}))
        assert _wait(lambda: monkey.refusal is not None)
        assert "ctx.steps(30), whose last step is 29; give a step below 30" in str(monkey.refusal)
    finally:
        monkey.stop()
    assert target.killed == []


def test_an_action_after_seconds_lets_the_ranks_go_on_and_fires_later(tmp_path) -> None:
    job, target = FakeJob(), FakeTarget(str(tmp_path))
    monkey = ChaosMonkey(parse_chaos("kill rank=1 at=4 after=0.5"), job, target)  # type: ignore[arg-type]
    monkey.start()
    try:
        (tmp_path / "reached-4").write_text("{}")
        # the ranks are not held for the half second: the kill lands wherever they are then
        assert _wait(lambda: (tmp_path / "released-4").exists(), timeout=0.4)
        assert target.killed == []
        assert _wait(lambda: target.killed == [101])
    finally:
        monkey.stop()


def test_a_corruption_waits_for_the_snapshot_in_flight_to_commit(tmp_path) -> None:
    """The ranks hold after step 12 once it came; its snapshot is still being replicated.
    Flipped before it committed, a buddy's copy was written whole after the flip (CI: the
    job recovered from it). The corruption, and the kill after it, wait for the commit."""
    job, target = FakeJob(), FakeTarget(str(tmp_path))
    job.committed = 11
    spec = parse_chaos("corrupt rank=1 at=12; kill rank=1 at=12")
    monkey = ChaosMonkey(spec, job, target)  # type: ignore[arg-type]
    monkey.start()
    try:
        (tmp_path / "reached-12").write_text(json.dumps({"rank": 0, "step": 12}))
        time.sleep(0.5)
        assert target.killed == []  # step 12's snapshot is not committed yet
        with job.lock:
            job.committed = 12
        assert _wait(lambda: target.killed == [-1, 101])
    finally:
        monkey.stop()


def _node_added_at_5(tmp_path) -> tuple[FakeJob, ChaosMonkey]:
    """A running monkey that has added a node at step 5 (its ranks not in the job yet)."""
    job, target = FakeJob(), FakeTarget(str(tmp_path))
    monkey = ChaosMonkey(parse_chaos("add node at=5"), job, target)  # type: ignore[arg-type]
    monkey.start()
    (tmp_path / "reached-5").write_text(json.dumps({"rank": 0, "step": 5}))
    assert _wait(lambda: target.killed == [1000])
    return job, monkey


def test_an_added_nodes_step_is_held_until_its_ranks_are_in_the_job(tmp_path) -> None:
    # The job grows at the step asked for: without the hold its last steps ran on while the
    # node's processes started, the job ended first, and it "succeeded" never having grown.
    job, monkey = _node_added_at_5(tmp_path)
    try:
        time.sleep(0.3)
        assert not (tmp_path / "released-5").exists()  # its ranks are not in the job yet
        with job.lock:
            job.ranks[2] = [2, 200]
        assert _wait(lambda: (tmp_path / "released-5").exists())
    finally:
        monkey.stop()
    assert monkey.unfired() == []


def test_an_added_node_whose_ranks_never_joined_fails_the_run(tmp_path) -> None:
    _job, monkey = _node_added_at_5(tmp_path)
    monkey.stop()  # the job ended: the held ranks go on
    assert (tmp_path / "released-5").exists()
    [line] = monkey.unfired()
    assert "'add node at=5' never took effect: node 2 started, but its ranks never joined" in line


def test_an_added_node_the_job_refuses_fails_the_run_with_the_reason(tmp_path) -> None:
    job, monkey = _node_added_at_5(tmp_path)
    try:
        with job.lock:
            job.refused_joins[2] = "job j cannot grow: it tracks data (a StatefulDataLoader)"
        assert _wait(lambda: (tmp_path / "released-5").exists())  # not held for 30 s
    finally:
        monkey.stop()
    [line] = monkey.unfired()
    assert line.endswith(
        "the job refused it: job j cannot grow: it tracks data (a StatefulDataLoader)"
    )
