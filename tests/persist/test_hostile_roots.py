"""Hostile checkpoint roots: what a reader allocates is bounded by what the root stores.

The audit of 2026-11-27 made ``inspect``, a cold start and ``export`` allocate 4–8 GiB from
roots of 16 KiB to 1.3 MB on disk: sparse data and metadata files (``truncate -s 8G``),
duplicated and aliased chunk records, msgpack that expands, and an O(n²) overlap check. Each
shape is built here on local disk and, where it exists there, on S3 (moto's server on
loopback), and every reader is run on it by ``bounded_reader.py`` in a process whose address
space is capped 1 GiB above what it needed for a valid root: the readers must end in a
``CheckpointError`` that names the cause, or read the root, and their Python allocations must
stay within a multiple of the bytes the root stores. A reader that asks for more fails with
``MemoryError`` (a torch ``RuntimeError`` for a tensor), which fails the test.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import crc32c
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from peerckpt.codec import pack, unpack
from peerckpt.manifest import META_KEY, ChunkRecord
from peerckpt.persist.durable import DurableStore
from peerckpt.persist.interop import full_tensors
from peerckpt.persist.localfs import SPARSE_FACTOR, SPARSE_SLACK

from ..conftest import REPO
from ..fuzz import LONG, SHORT

FEW = settings(SHORT, max_examples=10)  # each example runs every reader: about a second

STEP = 3
GiB = 1 << 30
BIG = 64 << 10  # rank 0's large tensor: what aliases and duplicates multiply


# -- roots -----------------------------------------------------------------------------------
@dataclass
class Root:
    """A committed step of two ranks (a sharded float32 weight, a replicated uint8 bias, a
    64 KiB tensor of rank 0's, each rank's state blob; node 0 and node 1 each wrote a data
    file), and ways to damage it."""

    store: DurableStore

    @property
    def local(self) -> bool:
        return self.store.local

    def path(self, name: str) -> str:
        return self.store.step_path(STEP, name)

    def manifest(self) -> dict[str, Any]:
        msg: dict[str, Any] = unpack(self.store.fs.cat_file(self.path("manifest.msgpack")))
        return msg

    def commit(self, msg: Any = None, raw: bytes | None = None) -> None:
        """Write a manifest and a marker that matches it: only its content is wrong."""
        raw = pack(msg) if raw is None else raw
        self.store.fs.pipe_file(self.path("manifest.msgpack"), raw)
        marker = pack({"step": STEP, "crc": crc32c.crc32c(raw)})
        self.store.fs.pipe_file(self.path("COMMITTED"), marker)

    def append(self, name: str, data: bytes) -> int:
        """Append ``data`` to the step's file ``name``; return where it starts."""
        old = self.store.fs.cat_file(self.path(name))
        self.store.fs.pipe_file(self.path(name), old + data)
        return len(old)

    def truncate(self, name: str, size: int) -> None:
        """Make the step's file ``name`` ``size`` bytes long: a sparse file (local only)."""
        assert self.local
        os.truncate(self.path(name), size)

    def stored(self) -> tuple[int, int, int]:
        """(metadata bytes, data bytes, files) the root holds: on local disk the blocks
        allocated (a sparse file's holes hold nothing), elsewhere the objects' sizes."""
        meta = data = files = 0
        for path in self.store.fs.find(self.store.root):
            if self.local:
                st = os.stat(path)
                held = min(st.st_size, st.st_blocks * 512) or st.st_size
            else:
                held = int(self.store.fs.size(path))
            files += 1
            if os.path.basename(path).startswith("data-"):
                data += held
            else:
                meta += held
        return meta, data, files


def _base(url: str) -> Root:
    store = DurableStore(url)
    bias = bytes(range(40))
    b = ChunkRecord("m/b", "uint8", (40,), (0,), (40,), 0, 40, crc32c.crc32c(bias))
    big = bytes(i % 253 for i in range(BIG))
    big_record = ChunkRecord("m/big", "uint8", (BIG,), (0,), (BIG,), 0, BIG, crc32c.crc32c(big))
    layouts: dict[int, list[ChunkRecord]] = {}
    for rank in (0, 1):
        w = bytes((7 * i + rank) % 256 for i in range(96))
        blob = pack({"step": STEP, "rank": rank})
        records = [
            ChunkRecord("m/w", "float32", (8, 6), (4 * rank, 0), (4, 6), 0, 96, crc32c.crc32c(w)),
            b,
            ChunkRecord(
                META_KEY, "uint8", (len(blob),), (0,), (len(blob),), 0, len(blob),
                crc32c.crc32c(blob), "rank",
            ),
        ]  # fmt: skip
        data = [w, bias, blob]
        if rank == 0:
            records.append(big_record)
            data.append(big)
        pieces = [(rank, r, d) for r, d in zip(records, data, strict=True) if rank == 0 or r != b]
        store.write_part(STEP, rank, pieces)
        layouts[rank] = records
    store.commit(STEP, epoch=1, layouts=layouts)
    return Root(store)


def _last_in(msg: dict[str, Any], file: str) -> list[Any]:
    """The record of the chunk stored last in ``file`` (no other chunk's bytes follow it)."""
    stored = [c for cs in msg["ranks"].values() for c in cs if c[0] == file]
    record: list[Any] = max(stored, key=lambda c: c[1][5])[1]
    return record


# -- the shapes ------------------------------------------------------------------------------
Shape = Callable[[Root], None]


def _shape(factory: Callable[..., Shape]) -> Callable[..., Shape]:
    """``factory`` whose shapes are named by the call that made them (hypothesis prints them:
    ``<function sparse_data(8589934592, 4294967296) at …>``)."""

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Shape:
        make = factory(*args, **kwargs)
        named = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        make.__qualname__ = f"{factory.__name__}({', '.join(named)})"
        return make

    return build


@_shape
def sparse_data(size: int, claim: int) -> Shape:
    """data-n0.bin made ``size`` bytes long in place (holes), its last chunk claiming ``claim``
    bytes of it: a uint8 vector that lies inside the file's size."""

    def make(root: Root) -> None:
        root.truncate("data-n0.bin", size)
        msg = root.manifest()
        record = _last_in(msg, "data-n0.bin")
        n = max(0, min(claim, size - record[5]))
        record[1:8] = ["uint8", [n], [0], [n], record[5], n, 0]
        root.commit(msg)

    return make


@_shape
def sparse_metadata(name: str, size: int) -> Shape:
    """The step's ``name`` (manifest, marker, a part) or the root's ``latest``, made ``size``
    bytes long with holes: read whole, it would be allocated whole."""

    def make(root: Root) -> None:
        if name == "latest":
            os.truncate(os.path.join(root.store.root, "latest"), size)
        else:
            root.truncate(name, size)

    return make


@_shape
def declared(length: int, where: str) -> Shape:
    """A record declaring ``length`` where the file holds far less: the bytes of the last
    chunk of data-n1.bin, or the global shape of the sharded weight."""

    def make(root: Root) -> None:
        msg = root.manifest()
        if where == "nbytes":
            record = _last_in(msg, "data-n1.bin")
            record[1:8] = ["uint8", [length], [0], [length], record[5], length, 0]
        elif where == "global_shape":
            for chunks in msg["ranks"].values():
                for _, record in chunks:
                    if record[0] == "m/w":
                        record[2] = [length, 6]
        else:
            msg["world_size"] = length
        root.commit(msg)

    return make


@_shape
def duplicated(times: int, whole_list: bool) -> Shape:
    """Rank 0's chunks listed ``times`` times (or its 64 KiB tensor, ``times`` more times)."""

    def make(root: Root) -> None:
        msg = root.manifest()
        chunks = msg["ranks"]["0"]
        big = next(c for c in chunks if c[1][0] == "m/big")
        msg["ranks"]["0"] = chunks * times if whole_list else chunks + [big] * times
        root.commit(msg)

    return make


@_shape
def aliased(times: int, shift: int) -> Shape:
    """``times`` tensors of their own whose records point into rank 0's 64 KiB tensor: all
    at exactly its bytes (``shift`` 0), or each ``shift`` bytes further in (overlapping)."""

    def make(root: Root) -> None:
        msg = root.manifest()
        file, big = next(c for c in msg["ranks"]["0"] if c[1][0] == "m/big")
        for i in range(times):
            skip = min(BIG - 1, (i + 1) * shift)
            n, at = BIG - skip, big[5] + skip
            msg["ranks"]["0"].append(
                [file, [f"m/a{i}", "uint8", [n], [0], [n], at, n, 0, "global"]]
            )
        root.commit(msg)

    return make


@_shape
def msgpack_bomb(kind: str, size: int) -> Shape:
    """A manifest of about ``size`` bytes, a valid head whose ``ranks`` expands: a list of
    empty maps or lists, arrays nested deep, a declared length with nothing after it, or a
    map of many ranks with no chunks (a manifest, read within bounds)."""

    def make(root: Root) -> None:
        n = size
        head = b"\x85\xa6format\x01\xa4step\x03\xa5epoch\x01\xaaworld_size\x01\xa5ranks"
        body = {
            "maps": b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n,
            "lists": b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n,
            "deep": b"\x91" * n + b"\xc0",
            "declared": b"\xdd\xff\xff\xff\xff\xc0",
            "ranks": b"\xdf"
            + (n // 8).to_bytes(4, "big")
            + b"".join(pack(str(i)) + b"\x90" for i in range(n // 8)),
        }[kind]
        root.commit(raw=head + body)

    return make


@_shape
def boxes(n: int, overlap: bool) -> Shape:
    """A uint8 vector of ``n`` elements stored as ``n`` boxes of one element, each with its
    own byte in data-n0.bin; ``overlap``: its last two boxes replaced by one of two elements
    a place too early, so that the sizes still add up to ``n`` while one element is covered
    twice and one never."""

    def make(root: Root) -> None:
        spans = [(i, 1) for i in range(n - 2)] + (
            [(n - 3, 2)] if overlap else [(n - 2, 1), (n - 1, 1)]
        )
        values = bytes(i % 251 for i in range(n))
        start = root.append("data-n0.bin", values)
        msg = root.manifest()
        at = start
        for offset, length in spans:
            crc = crc32c.crc32c(values[at - start : at - start + length])
            record = ["m/v", "uint8", [n], [offset], [length], at, length, crc, "global"]
            msg["ranks"]["0"].append(["data-n0.bin", record])
            at += length
        root.commit(msg)

    return make


_sizes = st.sampled_from([1 << 20, 1 << 30, 8 * GiB, 1 << 40])
_counts = st.integers(2, 1000)
remote_shapes = st.one_of(
    st.builds(declared, st.sampled_from([1 << 20, 1 << 33, 1 << 46]), st.sampled_from(
        ["nbytes", "global_shape", "world_size"]
    )),
    st.builds(duplicated, _counts, st.booleans()),
    st.builds(aliased, _counts, st.sampled_from([0, 0, 1, 7])),
    st.builds(
        msgpack_bomb,
        st.sampled_from(["maps", "lists", "deep", "declared", "ranks"]),
        st.integers(1, 100_000),
    ),
    st.builds(boxes, st.integers(3, 1000), st.booleans()),
)  # fmt: skip
local_shapes = st.one_of(
    remote_shapes,
    st.builds(sparse_data, _sizes, _sizes),
    st.builds(
        sparse_metadata,
        st.sampled_from(["manifest.msgpack", "COMMITTED", "part-n0.msgpack", "latest"]),
        _sizes,
    ),
)


# -- the reader process ----------------------------------------------------------------------
class Reader:
    """``bounded_reader.py`` in its own process: every reader, capped address space."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.persist.bounded_reader"],
            cwd=REPO,
            env={**os.environ, **env, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def read(self, url: str, warm_up: bool = False) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"url": url, "warm_up": warm_up}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            pytest.fail(f"the reader process died (exit status {self.proc.wait(10)})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """A real S3 server on loopback (moto's server mode) with a bucket, for this module; the
    variables that point botocore at it, set here and given to the reader process."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        try:
            s3fs.S3FileSystem().mkdir("peerckpt-hostile")
            yield env
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            server.stop()


@pytest.fixture(scope="module")
def reader(s3: dict[str, str]) -> Iterator[Reader]:
    """The reader process, warmed up on an intact root on each storage (then capped): what
    the first reads allocate once (imports, s3fs's connections) is not counted later."""
    proc = Reader(s3)
    roots = [_fresh(local=True), _fresh(local=False)]
    try:
        for i, root in enumerate(roots):
            answer = proc.read(root.store.url, warm_up=i == len(roots) - 1)
            assert set(answer["outcomes"].values()) == {"ok"}, answer
        yield proc
    finally:
        for root in roots:
            _remove(root)
        proc.close()


def _fresh(local: bool) -> Root:
    if local:
        return _base(tempfile.mkdtemp(prefix="peerckpt-hostile-"))
    return _base(f"s3://peerckpt-hostile/{secrets.token_hex(6)}")


def _remove(root: Root) -> None:
    if root.local:
        shutil.rmtree(root.store.root, ignore_errors=True)
    else:
        root.store.fs.rm(root.store.root, recursive=True)


def check_bounded(reader: Reader, shape: Shape, local: bool) -> dict[str, Any]:
    """Build ``shape`` on a fresh root, run every reader on it; assert each ended in a
    CheckpointError with a message or read the root, within the memory the root justifies."""
    root = _fresh(local)
    try:
        shape(root)
        meta, data, files = root.stored()
        answer = reader.read(root.store.url)
    finally:
        _remove(root)
    for name, outcome in answer["outcomes"].items():
        if outcome != "ok":
            assert outcome["checkpoint_error"] and outcome["message"], (name, outcome)
    # A manifest costs at most 64 bytes of memory per byte, decoded and checked (measured
    # worst, 48: many ranks without chunks); a data file may be read up to SPARSE_FACTOR times
    # what its disk holds (compression), twice at once (a chunk and the image it goes into).
    limit = 64 * meta + 2 * (SPARSE_FACTOR * data + SPARSE_SLACK * files) + (8 << 20)
    assert answer["peak"] <= limit, (answer, meta, data)
    return answer


# -- the audit's shapes, one each at its size ------------------------------------------------
READERS = ("inspect", "cold start", "export", "dcp")
DATA_READERS = ("cold start", "export")  # inspect reports damaged chunks; dcp's metadata reads none


def _refused(answer: dict[str, Any], *words: str, readers: tuple[str, ...] = READERS) -> None:
    """Each of ``readers`` refused the root with a message naming ``words``."""
    for name in readers:
        outcome = answer["outcomes"][name]
        assert outcome != "ok", (name, answer)
        for word in words:
            assert word in outcome["message"], (name, outcome)


def test_a_sparse_data_file_is_refused_before_its_size_is_allocated(reader: Reader) -> None:
    # 16 KiB on disk, 8 GiB of size; the weight's last chunk claims 4 GiB of it
    answer = check_bounded(reader, sparse_data(8 * GiB, 4 * GiB), local=True)
    _refused(answer, "data-n0.bin is a sparse file", "8589934592 bytes", readers=DATA_READERS)


@pytest.mark.parametrize("name", ["manifest.msgpack", "COMMITTED", "part-n0.msgpack", "latest"])
def test_a_sparse_metadata_file_is_never_read_whole(reader: Reader, name: str) -> None:
    answer = check_bounded(reader, sparse_metadata(name, 4 * GiB), local=True)
    if name in ("manifest.msgpack", "COMMITTED"):  # the step is not committed: nothing to read
        _refused(answer, "no committed checkpoint", readers=READERS[1:])


@pytest.mark.parametrize("local", [True, False], ids=["local", "s3"])
def test_aliased_records_are_refused(reader: Reader, local: bool) -> None:
    # 2,000 tensors whose records all name the same 64 KiB: an export of 128 MB
    answer = check_bounded(reader, aliased(2000, 0), local)
    _refused(answer, "both claim bytes", "aliased records")
    answer = check_bounded(reader, aliased(50, 1), local)  # each a byte further: overlapping
    _refused(answer, "overlap in data-n0.bin")


@pytest.mark.parametrize("local", [True, False], ids=["local", "s3"])
def test_duplicated_records_are_refused(reader: Reader, local: bool) -> None:
    answer = check_bounded(reader, duplicated(2000, whole_list=True), local)
    _refused(answer, "rank 0 lists chunk", "twice")


@pytest.mark.parametrize("kind", ["maps", "lists", "deep", "declared", "ranks"])
def test_a_manifest_whose_msgpack_expands_is_refused_within_bounds(
    reader: Reader, kind: str
) -> None:
    # 1.3 MB of manifest: it decoded to 100 MB of Python objects (a list of empty maps)
    size = 300_000 if kind == "ranks" else 1_300_000  # ranks: a manifest, read (slowly)
    answer = check_bounded(reader, msgpack_bomb(kind, size), local=True)
    if kind != "ranks":  # many ranks with no chunks is a manifest: it is read, within bounds
        _refused(answer, "manifest.msgpack")


def test_many_boxes_of_one_tensor_are_read_within_bounds(reader: Reader) -> None:
    answer = check_bounded(reader, boxes(2000, overlap=False), local=True)
    assert set(answer["outcomes"].values()) == {"ok"}, answer
    answer = check_bounded(reader, boxes(2000, overlap=True), local=True)
    assert "some overlap" in answer["outcomes"]["export"]["message"], answer


def test_export_checks_20000_boxes_of_one_tensor_in_seconds(tmp_path: Any) -> None:
    """Every pair of boxes was compared: minutes for 20,000 (the audit's shape was killed
    after 120 s here); now linear, about two seconds, most of it reading 20,000 chunks."""
    root = _base(str(tmp_path / "ckpt"))
    boxes(20_000, overlap=False)(root)
    started = time.monotonic()
    tensors = full_tensors(root.store.open())
    assert time.monotonic() - started < 60, "20,000 boxes of one tensor took a minute"
    assert tensors["m.v"].tolist() == [i % 251 for i in range(20_000)]


# -- fuzzing ---------------------------------------------------------------------------------
@FEW
@given(local_shapes)
@example(sparse_data(1 << 40, 1 << 40))
@example(declared(1 << 46, "nbytes"))
def test_fuzz_hostile_local_roots(reader: Reader, shape: Shape) -> None:
    check_bounded(reader, shape, local=True)


@pytest.mark.slow  # ~20 s; every reader on every S3 shape runs in make test above
@settings(FEW, max_examples=6)  # each S3 example makes dozens of requests to moto
@given(remote_shapes)
def test_fuzz_hostile_s3_roots(reader: Reader, shape: Shape) -> None:
    check_bounded(reader, shape, local=False)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@settings(LONG, max_examples=300)
@given(local_shapes)
def test_fuzz_hostile_local_roots_long(reader: Reader, shape: Shape) -> None:
    check_bounded(reader, shape, local=True)
