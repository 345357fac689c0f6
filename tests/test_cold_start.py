"""A whole-job restart: no memory copy is left, the job loads its latest durable step.

The first job (4 ranks) writes durable checkpoints; the second (2 ranks, a new job on the same
storage) finds them, restores the latest committed step resharded into its own topology, and
goes on from the next step. The restored model and optimizer must equal, bit for bit, what the
first job had at that step.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import crc32c
import pytest

from peerckpt.codec import pack, unpack
from peerckpt.persist.durable import DurableStore

from .conftest import read_jsonl, run_job


def _cold_start_4_to_2(tmp_path, url: str) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    run = run_job(
        first,
        script_args=["--steps", "12", "--sleep", "0.05"],
        extra=["--persist", url, "--persist-every", "5"],
    )
    assert run.returncode == 0, run.log[-4000:]
    step = DurableStore(url).latest_step()
    # Whatever the flushes every 5 steps did (one still running when the next is due skips
    # that one), the job's last step is flushed as it ends, and reported.
    written = [f["step"] for f in run.report["flushes"] if f["state"] == "committed"]
    why = f"flushes {run.report['flushes']}\n{run.log[-3000:]}"
    assert step == 11 and written and written[-1] == step, why
    committed = {e["digest"] for e in read_jsonl(first / "rank0.jsonl") if e["step"] == step}
    run = run_job(
        second,
        script_args=["--steps", "16"],
        nodes=1,
        extra=["--persist", url, "--persist-every", "5"],
    )
    assert run.returncode == 0, run.log[-4000:]
    restored = read_jsonl(second / "restored.jsonl")
    assert sorted(r["rank"] for r in restored) == [0, 1]
    for r in restored:
        assert r["step"] == step and r["world"] == 2 and {r["digest"]} == committed
    [event] = run.report["events"]
    assert event["kind"] == "cold_start" and event["old_world"] == 4
    assert {p["source"] for p in event["pulls"]} == {-1}  # every byte from storage
    resumed = [e["step"] for e in read_jsonl(second / "rank0.jsonl")]
    assert resumed[0] == step + 1 and resumed[-1] == 15
    assert DurableStore(url).latest_step() > step  # and it goes on writing checkpoints


@pytest.mark.slow  # make test runs the S3 case of the same path; local storage: test_durable_jobs
def test_a_restarted_job_loads_the_latest_local_checkpoint_into_fewer_ranks(tmp_path) -> None:
    _cold_start_4_to_2(tmp_path, f"file://{tmp_path}/ckpt")


@pytest.fixture
def s3_url(monkeypatch) -> Iterator[str]:
    """A real S3 server on loopback (moto's server mode), and a bucket on it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }.items():
        monkeypatch.setenv(name, value)
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("peerckpt-test")
        yield "s3://peerckpt-test/ckpt"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()
    with pytest.raises(OSError):  # the server is gone: nothing of it outlives the test
        socket.create_connection((host, port), timeout=1).close()


def test_a_restarted_job_loads_the_latest_s3_checkpoint_into_fewer_ranks(tmp_path, s3_url) -> None:
    _cold_start_4_to_2(tmp_path, s3_url)


@pytest.mark.slow  # make test: tests/persist/test_untrusted.py, test_fuzz.py (damaged manifests)
def test_a_damaged_checkpoint_is_refused_by_name_and_allow_older_falls_back(tmp_path) -> None:
    url = f"file://{tmp_path}/ckpt"
    first = tmp_path / "first"
    run = run_job(
        first, script_args=["--steps", "12"], extra=["--persist", url, "--persist-every", "5"]
    )
    assert run.returncode == 0, run.log[-4000:]
    store = DurableStore(url)
    assert store.committed_steps()[-2:] == [10, 11]  # every 5 steps, and the last one
    victim = next(c for c in store.open(11).chunks(0) if c.record.key.startswith("model/"))
    path = tmp_path / "ckpt" / "step-000000000011" / victim.file
    raw = bytearray(path.read_bytes())
    raw[victim.record.byte_offset + 3] ^= 0x10  # bit rot on the storage
    path.write_bytes(bytes(raw))

    refused = run_job(
        tmp_path / "second", script_args=["--steps", "16"], nodes=1, extra=["--persist", url]
    )
    assert refused.returncode == 1
    reason = refused.report["reason"]
    assert f"{victim.record.key!r} of step 11 fails verification" in reason
    assert victim.file in reason and "--allow-older" in reason

    third = tmp_path / "third"
    run = run_job(
        third, script_args=["--steps", "16"], nodes=1, extra=["--persist", url, "--allow-older"]
    )
    assert run.returncode == 0, run.log[-4000:]
    assert "step 11 in" in run.log and "is damaged" in run.log
    committed = {e["digest"] for e in read_jsonl(first / "rank0.jsonl") if e["step"] == 10}
    restored = read_jsonl(third / "restored.jsonl")
    assert [r["step"] for r in restored] == [10, 10]
    assert {r["digest"] for r in restored} == committed
    assert DurableStore(url).latest_step() == 15  # the third job's last step, flushed at its end

    # A manifest that passes its checksum but is malformed is damage like any other: named,
    # and skipped with --allow-older (it used to crash the coordinator with a TypeError).
    manifest = tmp_path / "ckpt" / "step-000000000015" / "manifest.msgpack"
    msg = unpack(manifest.read_bytes())
    msg["ranks"]["0"][0][1][6] = "many"  # nbytes
    manifest.write_bytes(pack(msg))
    marker = manifest.with_name("COMMITTED")
    marker.write_bytes(pack({"step": 15, "crc": crc32c.crc32c(manifest.read_bytes())}))
    fourth = tmp_path / "fourth"
    run = run_job(
        fourth, script_args=["--steps", "16"], nodes=1, extra=["--persist", url, "--allow-older"]
    )
    assert run.returncode == 0, run.log[-4000:]
    assert "manifest.msgpack: rank 0 chunk 0 nbytes must be an integer" in run.log
    restored = read_jsonl(fourth / "restored.jsonl")  # 15 is malformed, 11 damaged: 10
    assert [r["step"] for r in restored] == [10, 10]
    assert {r["digest"] for r in restored} == committed
