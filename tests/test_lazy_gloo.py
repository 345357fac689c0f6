"""gloo groups whose pairs connect lazily (``TORCH_GLOO_LAZY_INIT``): when the runtime asks for
them, that an abort still cuts the pairs connected after the group formed, and that a job
killed on purpose under them recovers bit for bit (``runtime/pg.py``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from typing import Any

import pytest

from peerckpt.runtime.pg import LAZY_GLOO_WORLD, gloo_environment, gloo_lazy

from .conftest import JobRun, assert_same_digests, run_job
from .runtime.test_inflight import _result, three_ranks


def test_gpu_jobs_and_large_cpu_jobs_connect_lazily_unless_told_otherwise() -> None:
    assert gloo_lazy("cpu:gloo,cuda:nccl", 2, {})
    assert not gloo_lazy("gloo", LAZY_GLOO_WORLD, {})
    assert gloo_lazy("gloo", LAZY_GLOO_WORLD + 1, {})
    assert gloo_lazy("gloo", 2, {"PEERCKPT_GLOO_LAZY": "1"})
    assert not gloo_lazy("cpu:gloo,cuda:nccl", 10_000, {"PEERCKPT_GLOO_LAZY": "0"})


def test_the_users_own_torch_gloo_lazy_init_wins() -> None:
    environ: dict[str, str] = {}
    assert gloo_environment(environ, None, True) and environ["TORCH_GLOO_LAZY_INIT"] == "1"
    assert not gloo_environment(environ, None, False) and environ["TORCH_GLOO_LAZY_INIT"] == "0"
    environ = {"TORCH_GLOO_LAZY_INIT": "0"}
    assert not gloo_environment(environ, "0", True) and environ["TORCH_GLOO_LAZY_INIT"] == "0"
    assert gloo_environment({}, "1", False)


def _three_ranks(
    lazy: str, pg_timeout_s: float
) -> contextlib.AbstractContextManager[list[subprocess.Popen[str]]]:
    """The three ranks of ``tests/runtime/lazy_gloo.py`` (rank 2 stops itself)."""
    env = dict(os.environ, PEERCKPT_GLOO_LAZY=lazy)
    env.pop("TORCH_GLOO_LAZY_INIT", None)
    return three_ranks("tests.runtime.lazy_gloo", str(pg_timeout_s), env=env)


def _abort_with_a_peer_stopped(lazy: str) -> list[dict[str, Any]]:
    with _three_ranks(lazy, pg_timeout_s=120.0) as procs:
        return [_result(proc, wait_s=90.0) for proc in procs[:2]]


def test_an_abort_cuts_the_pairs_gloo_connected_after_the_group_formed() -> None:
    """Rank 2 stops with its connections open (a lost node); the survivors' aborts must
    release their all-reduce at once. Their pairs were connected by their first all-reduce,
    after the group formed: an abort that cut only what the group opened while forming (the
    store client) left the all-reduce waiting out the group's timeout (120 s here)."""
    ranks = _abort_with_a_peer_stopped("1")
    # Lazy: a pair connects when either end first uses it, so which pairs a survivor opened at
    # its first all-reduce, and which it accepted while still forming, varies from run to run;
    # the pair between the two survivors is opened by whichever all-reduces first, after its
    # group formed, so together they connected at least one late.
    assert sum(rank["opened_first_all_reduce"] for rank in ranks) >= 1, ranks
    for rank in ranks:
        assert rank["lazy"], rank
        # cut: the store client and the pair to the stopped rank at least, never the listener
        # (the pair between the two survivors may be gone already, closed by the other's
        # abort); released long before the group's timeout (120 s), which is what an abort
        # that cut only what the group opened while forming waited out
        assert rank["cut"] >= 2, rank
        assert rank["all_reduce"] != "finished" and rank["seconds"] < 20.0, rank


@pytest.mark.slow
def test_an_eager_group_connects_every_pair_while_it_forms_and_its_abort_cuts_them() -> None:
    for rank in _abort_with_a_peer_stopped("0"):
        assert not rank["lazy"] and rank["opened_first_all_reduce"] == 0, rank
        assert rank["cut"] >= 2, rank  # as above
        assert rank["all_reduce"] != "finished" and rank["seconds"] < 20.0, rank


@pytest.mark.slow
def test_a_job_killed_under_lazy_gloo_recovers_bit_exact(
    tmp_path, monkeypatch: pytest.MonkeyPatch, reference_run: JobRun
) -> None:
    """The 2 x 2 DDP job, its pairs connected lazily, a rank killed at step 15: every digest
    equals the fault-free run's (whose pairs connected eagerly: the same bits either way)."""
    monkeypatch.setenv("PEERCKPT_GLOO_LAZY", "1")
    monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    run = run_job(tmp_path, script_args=["--steps", "30"], chaos="kill rank=1 at=15")
    assert run.returncode == 0, run.log[-4000:]
    assert "gloo connects its pairs lazily" in run.log, run.log[-4000:]
    assert "gloo connects its pairs while the group forms" not in run.log
    [event] = run.report["events"]
    assert event["ranks"] == [1] and event["resumed_at"] is not None
    assert_same_digests(run, reference_run)
