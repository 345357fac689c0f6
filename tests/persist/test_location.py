"""A storage URL that cannot work is named with its fix before anything depends on it, and
``inspect``/``export`` refuse what is not a checkpoint instead of reporting it empty."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import _registry as registry_target
from fsspec.registry import known_implementations, register_implementation

from peerckpt.errors import CheckpointError, StorageUnusable
from peerckpt.launch.base import JobSpec
from peerckpt.launch.cli import main
from peerckpt.persist.config import PersistConfig
from peerckpt.persist.durable import DurableStore
from peerckpt.persist.location import check_scheme, check_shared, check_writable
from peerckpt.runtime.api import resilient

from .test_durable import _write


def test_an_unknown_scheme_is_named() -> None:
    with pytest.raises(StorageUnusable, match="storage URL 'bogus://x/ckpt' has an unknown scheme"):
        check_scheme("bogus://x/ckpt")
    with pytest.raises(StorageUnusable, match="unknown scheme 'bogus'"):
        check_scheme("simplecache::bogus://x/ckpt")  # every link of a chained URL
    with pytest.raises(StorageUnusable, match="unknown scheme"):
        DurableStore("bogus://x/ckpt")  # what every reader and writer opens


def test_a_scheme_whose_backend_is_not_installed_names_the_pip_install() -> None:
    # As gs:// without gcsfs: fsspec knows the scheme, the package that serves it is missing.
    register_implementation("ptnopkg", "peerckpt_no_such_pkg.FS", errtxt="install it")
    try:
        with pytest.raises(StorageUnusable) as exc:
            check_scheme("ptnopkg://bucket/ckpt")
    finally:
        known_implementations.pop("ptnopkg", None)
    message = str(exc.value)
    assert "'ptnopkg://bucket/ckpt' needs the fsspec backend of ptnopkg://" in message
    assert "pip install peerckpt_no_such_pkg" in message


@pytest.mark.parametrize(
    "where", ["/proc/peerckpt-x/ckpt", "{tmp}/a-file/ckpt", "faulty://{tmp}/a-file/ckpt"]
)
def test_a_location_nobody_can_write_is_named(tmp_path, where: str) -> None:
    (tmp_path / "a-file").write_text("")
    url = where.format(tmp=tmp_path)
    with pytest.raises(StorageUnusable, match="is not writable") as exc:
        check_writable(url)
    assert repr(url) in str(exc.value) and "--persist" in str(exc.value)


@pytest.mark.parametrize("scheme", ["", "file://", "faulty://"])
def test_a_writable_location_is_made_and_left_empty(tmp_path, scheme: str) -> None:
    root = tmp_path / "a" / "ckpt"
    check_writable(f"{scheme}{root}", mode=0o640)
    assert root.is_dir() and os.listdir(root) == []  # the probe is gone
    if scheme != "faulty://":  # local files get the mode; fsspec backends their own
        assert oct(root.stat().st_mode & 0o777) == oct(0o750)  # as a flush makes it


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("/nonexistent-peerckpt", "nothing at /nonexistent-peerckpt (no such file or directory)"),
        ("/etc/passwd", "/etc/passwd is a file, not a checkpoint root"),
        ("{tmp}/empty", "holds no checkpoint (no step-* directory)"),
        ("bogus://x", "storage URL 'bogus://x' has an unknown scheme 'bogus'"),
    ],
)
def test_inspect_of_what_is_not_a_checkpoint_fails_naming_it(tmp_path, capsys, what, message):
    (tmp_path / "empty").mkdir()
    url = what.format(tmp=tmp_path)
    assert main(["inspect", url, "--verify"]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_inspect_of_steps_never_committed_lists_them_and_fails(tmp_path, capsys) -> None:
    store = DurableStore(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match="cannot be committed"):
        _write(store, step=4, skip_node=1)  # a writer is missing: the step never commits
    assert main(["inspect", str(tmp_path / "ckpt")]) == 1
    out = capsys.readouterr().out
    assert "never committed (ignored by readers): [4]" in out and "no committed step" in out


def test_export_of_what_is_not_there_fails_and_writes_no_file(tmp_path, capsys) -> None:
    store = DurableStore(str(tmp_path / "ckpt"))
    _write(store, step=4)
    out = tmp_path / "m.safetensors"
    assert main(["export", store.url, "--out", str(out), "--prefix", "nosuch"]) != 0
    assert "no shared tensor under prefix 'nosuch'" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "empty"), "--out", str(out)]) != 0
    assert "no committed checkpoint" in capsys.readouterr().err
    assert not out.exists()


class _SharedNothing(MemoryFileSystem):
    """A backend built on fsspec's memory filesystem, under a scheme of its own."""

    protocol = ("ptmemsub",)


@pytest.mark.parametrize(
    "url", ["memory://ckpt", "memory://x/ckpt", "simplecache::memory://x/ckpt", "ptmemsub://x"]
)
def test_a_store_inside_one_process_is_refused_before_any_job_uses_it(url: str) -> None:
    # The probe passed there, then every flush failed ('6 chunk(s) were not written'): each
    # agent wrote into its own process's memory, which no other process or later run sees.
    register_implementation("ptmemsub", _SharedNothing, clobber=True)
    try:
        checks: list[Callable[[str], object]] = [
            check_shared,
            check_writable,
            lambda u: PersistConfig.from_settings(u, None, None, None),  # --persist, persist=
            lambda u: JobSpec(script=__file__, persist={"url": u, "every": 1}).check(),
        ]
        for check in checks:
            with pytest.raises(StorageUnusable) as exc:
                check(url)
            message = str(exc.value)
            assert f"storage URL {url!r} is fsspec's in-memory filesystem" in message
            assert "lives inside one process" in message and "file://" in message
    finally:
        known_implementations.pop("ptmemsub", None)
        registry_target.pop("ptmemsub", None)
    DurableStore(f"memory://peerckpt-location-{os.getpid()}/ckpt")  # readers may open one
    check_shared("file:///tmp/x")
    check_shared("s3://bucket/x")


def test_memory_persist_is_refused_by_the_command_line_and_the_decorator(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    assert main(["run", "--persist", "memory://ckpt", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("peerckpt: storage URL 'memory://ckpt' is fsspec's in-memory")
    assert list(tmp_path.iterdir()) == [script]
    with pytest.raises(StorageUnusable, match="lives inside one process"):
        resilient(persist="memory://ckpt")
