"""The job view every observer shows, and the metrics computed from it."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from peerckpt.launch.metrics import registry
from peerckpt.launch.view import RepairKind, build_view, recovery_kind, transfer_seconds
from peerckpt.messages.control import Pull
from peerckpt.states import EpochMode, RecoveryKind
from tests.launch.observed import CHAOS, EVENT, T0, event, status


def _samples(view) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry(lambda: view)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_view_places_every_rank_and_its_copies_and_costs_each_recovery() -> None:
    view = build_view(status(), chaos=CHAOS)
    ranks = {r.rank: r for r in view.ranks}
    assert ranks[2].node == 2 and ranks[2].copies == (1, 2) and ranks[2].buddies == (1,)
    # Rank 0's newest step comes from its node's heartbeat (44), newer than replication's.
    assert ranks[0].snapshot_step == 44 and ranks[0].lag == 3
    assert ranks[2].snapshot_step == 41 and ranks[2].lag == 0  # only the coordinator knows it
    assert view.lag == 3 and view.durable_step == 20 and view.spares == 1
    nodes = {n.node: n for n in view.nodes}
    assert nodes[2].spare and nodes[2].ranks == (2,) and nodes[2].memory == {}
    assert nodes[1].memory["replicas"] == 8192 and nodes[0].replicated_bytes == 900
    (rec,) = view.recoveries
    assert rec.cause == "kill rank=2 at=30" and rec.kind is RepairKind.RANK
    assert round(rec.detection_s, 3) == 0.02 and rec.transfer_s == 0.03
    assert round(rec.restore_s, 3) == 0.2 and round(rec.total_s, 3) == 0.25
    assert rec.network_bytes == 5000 and rec.local_bytes == 4000 and rec.storage_bytes == 0
    assert view.to_json()["recoveries_total"] == {"rank": 1, "node": 0, "reshard": 0, "storage": 0}
    assert not view.recovering and view.to_json()["flushes"] == {"committed": 1, "failed": 1}


def test_an_unfinished_recovery_is_under_way_and_not_counted() -> None:
    view = build_view(status(events=[replace(EVENT, resumed_at=None)]), chaos=CHAOS)
    assert view.recovering and view.recoveries_total[RepairKind.RANK] == 0
    assert view.recoveries[0].restore_s is None and view.recoveries[0].total_s is None


def test_recovery_kinds_and_transfer_over_resharding_rounds() -> None:
    assert recovery_kind(event(RecoveryKind.NODE, mode=EpochMode.SAME)) is RepairKind.NODE
    assert recovery_kind(event(RecoveryKind.RANK, mode=EpochMode.RESHARD)) is RepairKind.RESHARD
    assert recovery_kind(event(RecoveryKind.GROW)) is RepairKind.RESHARD
    assert recovery_kind(event(RecoveryKind.COLD_START)) is RepairKind.STORAGE
    from_storage = event(RecoveryKind.NODE, pulls=[Pull(0, 1, -1, 8, 0.1)])
    assert recovery_kind(from_storage) is RepairKind.STORAGE
    pulls = [Pull(0, 1, 0, 8, 0.1, round=0), Pull(1, 1, 0, 8, 0.3, 0), Pull(0, 1, 0, 8, 0.2, 1)]
    assert transfer_seconds(pulls) == 0.3 + 0.2 and transfer_seconds([]) is None


def test_a_same_topology_pull_has_no_round() -> None:
    """A ``Pull`` outside resharding has ``round`` None: one round, 0."""
    pulls = [Pull(1, 2, 0, 1 << 20, 0.25), Pull(3, 2, 1, 1 << 20, 0.5)]
    assert pulls[0].round is None
    assert transfer_seconds(pulls) == 0.5


def test_metrics_parse_and_carry_the_view() -> None:
    got = _samples(build_view(status(), chaos=CHAOS))
    job = (("job", "demo"),)
    assert got[("peerckpt_committed_step", job)] == 41
    assert got[("peerckpt_epoch", job)] == 1 and got[("peerckpt_world_size", job)] == 4
    assert got[("peerckpt_durable_step", job)] == 20 and got[("peerckpt_spares", job)] == 1
    assert got[("peerckpt_recoveries_total", (("job", "demo"), ("kind", "rank")))] == 1
    assert got[("peerckpt_recoveries_total", (("job", "demo"), ("kind", "storage")))] == 0
    total = (("job", "demo"), ("phase", "total"))
    assert got[("peerckpt_recovery_seconds_count", total)] == 1
    assert round(got[("peerckpt_recovery_seconds_sum", total)], 3) == 0.25
    bucket = (("job", "demo"), ("le", "0.25"), ("phase", "restore"))
    assert got[("peerckpt_recovery_seconds_bucket", bucket)] == 1
    bucket = (("job", "demo"), ("le", "0.1"), ("phase", "restore"))
    assert got[("peerckpt_recovery_seconds_bucket", bucket)] == 0
    node0 = (("job", "demo"), ("node", "0"))
    assert got[("peerckpt_snapshot_bytes_total", node0)] == 1000
    assert got[("peerckpt_replicated_bytes_total", node0)] == 900
    mem = (("job", "demo"), ("kind", "replicas"), ("node", "1"))
    assert got[("peerckpt_memory_bytes", mem)] == 8192
    assert got[("peerckpt_replication_lag_steps", (("job", "demo"), ("rank", "0")))] == 3
    assert got[("peerckpt_committed_copies", (("job", "demo"), ("rank", "2")))] == 2
    state = (("job", "demo"), ("state", "running"))
    assert got[("peerckpt_job_state", state)] == 1


def test_no_label_takes_an_unbounded_value() -> None:
    """Labels are job, node, rank and fixed words: never a step, a pid or free text."""
    allowed = {"job", "node", "rank", "kind", "phase", "state", "le"}
    view = build_view(status(), chaos=CHAOS)
    for (name, labels), _ in _samples(view).items():
        assert {k for k, _ in labels} <= allowed, name
        for key, value in labels:
            if key in ("node", "rank"):
                assert int(value) < 10, (name, labels)


def test_no_series_before_the_first_status() -> None:
    assert generate_latest(registry(lambda: None)).decode() == ""


def test_a_recovery_without_an_injected_fault_has_no_detection_time() -> None:
    view = build_view(status())
    (rec,) = view.recoveries
    assert rec.detection_s is None and rec.fault_at is None
    assert round(rec.total_s, 3) == round(T0 + 10.25 - (T0 + 10.02), 3)


def test_the_grafana_dashboard_uses_only_metrics_that_exist() -> None:
    import json
    import re

    from tests.conftest import REPO

    dashboard = json.loads((REPO / "examples" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"peerckpt_[a-z_]+", e)}
    exported = {name for name, _ in _samples(build_view(status(), chaos=CHAOS))}
    assert used and used <= exported, used - exported
    assert all('job="$job"' in e for e in exprs), "every panel is about the chosen job"


def test_a_lost_node_keeps_its_counters_but_holds_no_memory() -> None:
    view = build_view(status(nodes={0: True, 1: False, 2: True}))
    lost = next(n for n in view.nodes if n.node == 1)
    assert not lost.alive and lost.memory == {} and lost.snapshot_bytes == 500
    got = _samples(view)
    assert ("peerckpt_memory_bytes", (("job", "demo"), ("kind", "slots"), ("node", "1"))) not in got
    assert got[("peerckpt_snapshot_bytes_total", (("job", "demo"), ("node", "1")))] == 500
    assert got[("peerckpt_node_up", (("job", "demo"), ("node", "1")))] == 0


def test_a_superseded_recovery_costs_until_the_repair_that_ended_it() -> None:
    first = replace(EVENT, resumed_at=None, epoch=1)
    second = replace(first, from_epoch=1, epoch=2, detected_at=T0 + 11.0, resumed_at=T0 + 11.5)
    view = build_view(status(events=[first, second]), chaos=CHAOS)
    old, new = view.recoveries
    assert old.superseded and old.resumed_at is None and new.resumed_at == T0 + 11.5
    assert round(old.total_s, 3) == round(T0 + 11.5 - (CHAOS[0].fired_at or 0.0), 3)
    assert view.recoveries_total[RepairKind.RANK] == 1  # counted once, by the repair that ended it
