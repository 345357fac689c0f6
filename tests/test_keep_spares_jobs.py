"""``--keep-spares`` on a job that cannot reshard (README: torchdata's StatefulDataLoader over
a DistributedSampler, tracked as data): the fresh spare node the launcher opens after the
first loss holds spares only and keeps the world's size, so it is never refused as a grow
(``recovery/unreshardable.py``); the second loss is recovered from it, bit for bit."""

from __future__ import annotations

import pytest

from .conftest import assert_same_digests, run_with_reference

STEPS = 16


@pytest.mark.slow  # make test: tests/recovery/test_unreshardable.py (a spares-only node)
def test_keep_spares_replenishes_a_job_whose_loader_cannot_reshard(tmp_path) -> None:
    reference, run = run_with_reference(
        tmp_path,
        ["--steps", str(STEPS), "--patterns", "stateful-loader"],
        script="user_loop.py",
        spares=1,
        chaos="kill rank=1 at=5; kill rank=2 at=11",
        extra=["--keep-spares"],
    )
    assert run.returncode == 0, run.log[-4000:]
    assert "cannot grow" not in run.log and "cannot be resharded" not in run.log
    first, second = run.report["events"]
    assert first["kind"] == second["kind"] == "rank"
    assert (first["ranks"], second["ranks"]) == ([1], [2])
    assert all(c["fired_at"] is not None for c in run.report["chaos"]), run.report["chaos"]
    assert "is the new spare node" in run.log  # the second loss took a replenished spare
    assert {(r, s) for r in range(4) for s in range(STEPS)} == set(run.digests())
    assert_same_digests(run, reference)
