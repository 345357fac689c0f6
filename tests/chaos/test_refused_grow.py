"""Chaos ``add node`` on a job that refuses to grow (it tracks a data loader that cannot
reshard): the action is skipped with the job's reason, the monkey goes on, nothing raises."""

from __future__ import annotations

from peerckpt.chaos.monkey import ChaosMonkey
from peerckpt.chaos.spec import parse_chaos
from peerckpt.errors import NotReshardable

from .test_monkey import FakeJob, FakeTarget, _wait


class RefusingTarget(FakeTarget):
    def add_node(self) -> int:
        raise NotReshardable("job j cannot grow: it tracks data (a StatefulDataLoader)")


def test_a_refused_add_node_is_skipped_with_the_reason_and_later_actions_still_fire() -> None:
    job, target = FakeJob(), RefusingTarget(None)
    job.live = {0: 6}
    actions = parse_chaos("add node at=3; kill rank=1 at=5")
    monkey = ChaosMonkey(actions, job, target, poll_s=0.01)  # type: ignore[arg-type]
    monkey.start()
    try:
        assert _wait(lambda: target.killed == [101])  # the next action fired
    finally:
        monkey.stop()
    [line] = monkey.unfired()
    assert line.startswith("chaos action 'add node at=3' never fired: skipped: the job refused")
    assert "cannot grow" in line
