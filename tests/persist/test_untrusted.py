"""A durable checkpoint root is input: nothing in it may reach outside it, hang, or blow up.

Each test plants what an attacker sharing the storage (or a damaged disk) could: a manifest
that passes its checksum but names a file outside the step, a link or a FIFO where a data
file belongs, sizes no file backs, fields of the wrong type. Every one must end in
``CorruptCheckpoint`` naming the file and what is wrong, before any large allocation.
"""

from __future__ import annotations

import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest

from peerckpt.codec import pack, unpack
from peerckpt.errors import CheckpointError, CorruptCheckpoint
from peerckpt.manifest import ChunkRecord
from peerckpt.persist import durable, localfs
from peerckpt.persist.durable import DurableStore
from peerckpt.persist.inspect import inspect
from peerckpt.persist.interop import PeerckptReader, export_safetensors

STEP = 7


def _commit(store: DurableStore, chunks: dict[str, bytes]) -> None:
    """Commit step STEP of one rank holding ``chunks`` (uint8 vectors), written by node 0."""
    records = {
        key: ChunkRecord(key, "uint8", (len(b),), (0,), (len(b),), 0, len(b), crc32c.crc32c(b))
        for key, b in chunks.items()
    }
    store.write_part(STEP, 0, [(0, records[k], b) for k, b in chunks.items()])
    store.commit(STEP, epoch=1, layouts={0: list(records.values())})


def _tamper(store: DurableStore, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the step's manifest through ``change`` and re-commit it with a matching marker:
    what passes the checksum is then only what the manifest says."""
    path = store.step_path(STEP, "manifest.msgpack")
    msg = unpack(store.fs.cat_file(path))
    change(msg)
    raw = pack(msg)
    store.fs.pipe_file(path, raw)
    store.fs.pipe_file(
        store.step_path(STEP, "COMMITTED"), pack({"step": STEP, "crc": crc32c.crc32c(raw)})
    )


def _claim(n: int) -> Callable[[dict[str, Any]], None]:
    """Make rank 0's last chunk (the last in its file: no other chunk's bytes follow it)
    claim ``n`` bytes where it starts."""

    def change(msg: dict[str, Any]) -> None:
        record = msg["ranks"]["0"][-1][1]
        record[2:8] = [[n], [0], [n], record[5], n, 0]

    return change


def _append_data(store: DurableStore, data: bytes) -> int:
    """Append ``data`` to node 0's data file of the step; return the offset it starts at."""
    with open(store.step_path(STEP, "data-n0.bin"), "ab") as f:
        f.write(data)
        return f.tell() - len(data)


def _point_chunk_at(msg: dict[str, Any], file: str, data: bytes) -> None:
    """Make rank 0's first chunk claim ``data`` (its size and checksum) in ``file``."""
    stored = msg["ranks"]["0"][0]
    stored[0] = file
    n = len(data)
    stored[1][2:8] = [[n], [0], [n], 0, n, crc32c.crc32c(data)]


@pytest.fixture
def local(tmp_path: Path) -> DurableStore:
    store = DurableStore(str(tmp_path / "root" / "ckpt"))
    _commit(store, {"model/w": bytes(range(200)), "model/b": b"bias" * 10})
    return store


@pytest.fixture(params=["memory", "file"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DurableStore]:
    if request.param == "memory":
        url = f"memory://peerckpt-untrusted-{secrets.token_hex(4)}/ckpt"
    else:
        url = str(tmp_path / "ckpt")
    store = DurableStore(url)
    _commit(store, {"model/w": bytes(range(200)), "model/b": b"bias" * 10})
    yield store
    if store.fs.exists(store.root):
        store.fs.rm(store.root, recursive=True)


# -- file names ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    ["../../secret.txt", "/etc/hostname", "../dev/zero", "data-n0.bin/../x", "part-n0.msgpack", ""],
)
def test_a_chunk_file_name_the_format_never_writes_is_refused(
    any_store: DurableStore, tmp_path: Path, name: str
) -> None:
    secret = b"the host's secret bytes"
    (tmp_path / "secret.txt").write_bytes(secret)  # outside the root, two levels above the step
    _tamper(any_store, lambda m: _point_chunk_at(m, name, secret))
    with pytest.raises(CorruptCheckpoint, match=r"manifest\.msgpack.*file name"):
        any_store.open()


def test_inspect_and_export_never_read_a_file_outside_the_step(
    local: DurableStore, tmp_path: Path
) -> None:
    secret = b"the host's secret bytes"
    (tmp_path / "root" / "secret.txt").write_bytes(secret)
    _tamper(local, lambda m: _point_chunk_at(m, "../../secret.txt", secret))
    with pytest.raises(CorruptCheckpoint, match="file name"):
        inspect(local.url, verify=True)
    out = tmp_path / "out.safetensors"
    with pytest.raises(CorruptCheckpoint, match="file name"):
        export_safetensors(local.url, str(out))
    assert not out.exists()
    with pytest.raises(CorruptCheckpoint, match="file name"):
        PeerckptReader(local.url).read_metadata()


def test_export_allocates_only_what_the_stored_boxes_cover(
    local: DurableStore, tmp_path: Path
) -> None:
    # A box (0, 200) of a tensor said to have 2**40 elements: the rest is nowhere.
    _tamper(local, _set(("ranks", "0", 0, 1, 2), [1 << 40]))
    with pytest.raises(CorruptCheckpoint, match=r"cover 200 of 1099511627776 elements"):
        export_safetensors(local.url, str(tmp_path / "out.safetensors"))


def test_overlapping_boxes_never_export_memory_nobody_wrote(
    local: DurableStore, tmp_path: Path
) -> None:
    extra = _append_data(local, bytes(100))  # bytes of their own: no record aliases another

    def overlap(msg: dict[str, Any]) -> None:
        chunks = msg["ranks"]["0"]
        chunks[0][1][2:5] = [[300], [0], [200]]  # w: elements 0-200 of 300
        twin = [chunks[0][0], list(chunks[0][1])]
        # and 50-150, from bytes that pass its checksum: 300 in all, yet 200-300 is unset
        twin[1][3:8] = [[50], [100], extra, 100, crc32c.crc32c(bytes(100))]
        chunks.append(twin)

    _tamper(local, overlap)
    with pytest.raises(CorruptCheckpoint, match=r"cover 300 of 300 elements \(some overlap"):
        export_safetensors(local.url, str(tmp_path / "out.safetensors"))


def test_boxes_of_one_tensor_that_disagree_on_its_dtype_are_refused(local: DurableStore) -> None:
    extra = _append_data(local, bytes(200))

    def second_box_of_w(msg: dict[str, Any]) -> None:
        chunks = msg["ranks"]["0"]
        twin = [chunks[0][0], list(chunks[0][1])]
        twin[1][1:7] = ["float32", [100], [0], [50], extra, 200]  # same key, another dtype
        chunks.append(twin)

    _tamper(local, second_box_of_w)
    with pytest.raises(CorruptCheckpoint, match=r"'model\.w'.*(uint8.*float32|float32.*uint8)"):
        PeerckptReader(local.url).read_metadata()


# -- what a data file may be -----------------------------------------------------------------
def test_a_data_file_that_is_a_link_is_not_followed(local: DurableStore, tmp_path: Path) -> None:
    secret = bytes(range(200))  # what the manifest expects, kept outside the root
    (tmp_path / "elsewhere.bin").write_bytes(secret)
    data = Path(local.step_path(STEP, "data-n0.bin"))
    original = data.read_bytes()
    data.unlink()
    data.symlink_to(tmp_path / "elsewhere.bin")
    ckpt = local.open()
    problems = ckpt.verify()
    assert problems and all("not a regular file" in p for p in problems)
    data.unlink()
    data.write_bytes(original)
    assert local.open().verify() == []


def test_a_link_to_dev_zero_with_a_huge_size_fails_before_allocating(local: DurableStore) -> None:
    data = Path(local.step_path(STEP, "data-n0.bin"))
    data.unlink()
    data.symlink_to("/dev/zero")
    huge = 1 << 46  # 64 TiB: allocating it is a MemoryError, reading it takes forever
    _tamper(local, _claim(huge))
    ckpt = local.open()
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        ckpt.slot_image(0)
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        ckpt.read(next(ckpt.chunks(0)))


def test_a_size_the_file_does_not_hold_fails_before_allocating(local: DurableStore) -> None:
    huge = 1 << 46
    _tamper(local, _claim(huge))
    ckpt = local.open()
    with pytest.raises(CorruptCheckpoint, match=r"data-n0\.bin holds only \d+ bytes"):
        ckpt.slot_image(0)


def test_a_size_beyond_the_file_is_refused_on_remote_storage_too() -> None:
    store = DurableStore(f"memory://peerckpt-untrusted-{secrets.token_hex(4)}/ckpt")
    try:
        _commit(store, {"model/w": bytes(range(200))})
        _tamper(store, _claim(1 << 46))
        with pytest.raises(CorruptCheckpoint, match=r"data-n0\.bin holds only \d+ bytes"):
            store.open().slot_image(0)
    finally:
        store.fs.rm(store.root, recursive=True)


def test_a_fifo_where_a_data_file_belongs_does_not_hang(local: DurableStore) -> None:
    data = Path(local.step_path(STEP, "data-n0.bin"))
    data.unlink()
    os.mkfifo(data)
    ckpt = local.open()
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            ckpt.read(next(ckpt.chunks(0)))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, name="fifo-reader", daemon=True)
    reader.start()
    reader.join(10.0)
    if reader.is_alive():  # release it: a writer opening the FIFO ends the reader's open
        fd = os.open(data, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        reader.join(10.0)
        pytest.fail("reading a chunk from a FIFO hung")
    assert isinstance(outcome[0], CorruptCheckpoint) and "not a regular file" in str(outcome[0])


def test_a_manifest_that_is_a_link_is_not_followed(local: DurableStore, tmp_path: Path) -> None:
    """The marker and manifest are read whole: a link could name a device that never ends."""
    manifest = Path(local.step_path(STEP, "manifest.msgpack"))
    copy = tmp_path / "manifest-elsewhere"
    copy.write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(copy)
    assert local.committed_steps() == []  # not a committed step: its manifest is not a file


def test_a_fifo_for_a_marker_does_not_hang(local: DurableStore) -> None:
    marker = Path(local.step_path(STEP, "COMMITTED"))
    marker.unlink()
    os.mkfifo(marker)
    found: list[list[int]] = []
    finder = threading.Thread(
        target=lambda: found.append(local.committed_steps()), name="finder", daemon=True
    )
    finder.start()
    finder.join(10.0)
    if finder.is_alive():
        os.close(os.open(marker, os.O_WRONLY | os.O_NONBLOCK))
        finder.join(10.0)
        pytest.fail("looking for committed steps hung on a FIFO")
    assert found == [[]]


def test_a_sparse_data_file_is_refused_when_opened(local: DurableStore) -> None:
    # 8 GiB of size in a few KiB of disk: its bytes read back as zeros, as many as asked
    os.truncate(local.step_path(STEP, "data-n0.bin"), 8 << 30)
    _tamper(local, _claim(4 << 30))
    ckpt = local.open()
    with pytest.raises(
        CorruptCheckpoint, match=r"data-n0\.bin is a sparse file: its size is 8589934592"
    ):
        ckpt.slot_image(0)


def test_a_file_that_holds_its_size_is_not_taken_for_sparse(tmp_path: Path) -> None:
    path = tmp_path / "dense"
    path.write_bytes(secrets.token_bytes(3 << 20))
    with localfs.open_regular(str(tmp_path), "dense") as (_, size):
        assert size == 3 << 20
    # holes of up to 15/16 of a file are let through (compressing file systems), no more
    with open(path, "r+b") as f:
        f.truncate(16 * (3 << 20))
    with localfs.open_regular(str(tmp_path), "dense") as (_, size):
        assert size == 48 << 20
    os.truncate(path, 17 * (3 << 20))
    with (
        pytest.raises(CorruptCheckpoint, match="sparse"),
        localfs.open_regular(str(tmp_path), "dense"),
    ):
        pass


@pytest.mark.parametrize("name", ["COMMITTED", "latest"])
def test_a_metadata_file_larger_than_its_kind_is_not_read(
    any_store: DurableStore, name: str
) -> None:
    path = any_store.step_path(STEP, name) if name == "COMMITTED" else f"{any_store.root}/latest"
    any_store.fs.pipe_file(path, b" " * 5000)  # a marker or a pointer is a few bytes
    if name == "COMMITTED":
        assert any_store.committed_steps() == []
    else:  # the pointer is only a hint: the step is found by listing
        assert any_store.latest_step() == STEP
    with pytest.raises(CorruptCheckpoint, match="more than the 4096 a file of its kind"):
        any_store._read(path, 4096)


def test_a_sparse_part_fails_the_commit(local: DurableStore) -> None:
    os.truncate(local.step_path(STEP, "part-n0.msgpack"), 4 << 30)
    with pytest.raises(CorruptCheckpoint, match=r"part-n0\.msgpack is a sparse file"):
        local.commit(STEP, epoch=1, layouts={0: []})


def test_a_manifest_too_large_for_readers_is_never_committed(
    local: DurableStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    layouts = {0: [c.record for c in local.open().chunks(0)]}
    part = len(local.fs.cat_file(local.step_path(STEP, "part-n0.msgpack")))
    assert len(local.fs.cat_file(local.step_path(STEP, "manifest.msgpack"))) > part
    monkeypatch.setattr(durable, "MANIFEST_MAX", part)  # the part is read, the manifest too big
    with pytest.raises(CheckpointError, match=rf"its manifest is \d+ bytes, more than the {part}"):
        local.commit(STEP, epoch=2, layouts=layouts)


# -- malformed fields ------------------------------------------------------------------------
def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(msg: dict[str, Any]) -> None:
        target: Any = msg
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value

    return change


MALFORMED = {
    "step": _set(("step",), "seven"),
    "negative step": _set(("step",), -1),
    "epoch": _set(("epoch",), None),
    "world_size": _set(("world_size",), [1]),
    "ranks": _set(("ranks",), [[0]]),
    "rank key": _set(("ranks",), {"zero": []}),
    "rank chunks": _set(("ranks", "0"), {"a": 1}),
    "stored chunk": _set(("ranks", "0", 0), ["data-n0.bin"]),
    "record": _set(("ranks", "0", 0, 1), "not a record"),
    "record length": _set(("ranks", "0", 0, 1), [1, 2, 3]),
    "key": _set(("ranks", "0", 0, 1, 0), 17),
    "dtype": _set(("ranks", "0", 0, 1, 1), "no_such_dtype"),
    "global_shape": _set(("ranks", "0", 0, 1, 2), ["a"]),
    "offsets": _set(("ranks", "0", 0, 1, 3), [-5]),
    "lengths": _set(("ranks", "0", 0, 1, 4), [1, 2]),
    "box outside the tensor": _set(("ranks", "0", 0, 1, 3), [150]),
    "byte_offset": _set(("ranks", "0", 0, 1, 5), -64),
    "nbytes": _set(("ranks", "0", 0, 1, 6), 3),
    "crc": _set(("ranks", "0", 0, 1, 7), "crc"),
    "scope": _set(("ranks", "0", 0, 1, 8), "everyone"),
    "not a map": lambda m: m.clear(),
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_a_malformed_manifest_that_passes_its_checksum_is_a_corrupt_checkpoint(
    any_store: DurableStore, what: str
) -> None:
    _tamper(any_store, MALFORMED[what])
    with pytest.raises(CorruptCheckpoint, match=r"manifest\.msgpack"):
        any_store.open()


def test_a_malformed_part_fails_the_commit_with_a_checkpoint_error(local: DurableStore) -> None:
    part = local.step_path(STEP, "part-n0.msgpack")
    local.fs.pipe_file(part, pack({"format": 1, "node": 0, "chunks": [[0, ["x"]]]}))
    with pytest.raises(CheckpointError, match=r"part-n0\.msgpack"):
        local.commit(STEP, epoch=1, layouts={0: []})


# -- how files are written -------------------------------------------------------------------
def _modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]
    }


def test_durable_files_are_private_to_their_owner_by_default(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _commit(DurableStore(str(root)), {"model/w": b"w" * 100})
    modes = _modes(root)
    assert modes.pop(".") == 0o700
    assert modes.pop("step-000000000007") == 0o700
    assert modes and set(modes.values()) == {0o600}, modes


def test_the_file_mode_is_configurable(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _commit(DurableStore(str(root), mode=0o640), {"model/w": b"w" * 100})
    modes = _modes(root)
    assert modes.pop(".") == modes.pop("step-000000000007") == 0o750
    assert set(modes.values()) == {0o640}, modes


@pytest.mark.parametrize("name", ["data-n0.bin", "manifest.msgpack.tmp", "latest.tmp"])
def test_a_write_never_follows_a_planted_link(tmp_path: Path, name: str) -> None:
    store = DurableStore(str(tmp_path / "ckpt"))
    _commit(store, {"model/w": b"w" * 100})
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    parent = tmp_path / "ckpt" if name == "latest.tmp" else tmp_path / "ckpt" / "step-000000000007"
    (parent / name).unlink(missing_ok=True)
    (parent / name).symlink_to(victim)
    with pytest.raises(CheckpointError, match="symbolic link"):
        _commit(store, {"model/w": b"w" * 100})
    assert victim.read_bytes() == b"precious"


def test_the_commit_renames_are_made_durable_with_a_directory_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[bool] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store = DurableStore(str(tmp_path / "ckpt"))
    _commit(store, {"model/w": b"w" * 100})
    # the part, the manifest, the marker (in the step) and latest (in the root) are renamed
    assert synced.count(True) >= 4, synced
