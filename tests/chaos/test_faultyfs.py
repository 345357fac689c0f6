"""faulty://: the storage faults the durable-tier tests inject, doing what they say."""

from __future__ import annotations

import errno

import fsspec
import pytest

from peerckpt.chaos.faultyfs import FAULT_FILE, FaultKind, parse_rules, rules_for


def test_rules_parse_and_apply_by_step_and_directory(tmp_path) -> None:
    (tmp_path / FAULT_FILE).write_text("enospc step=10 after=5  # a comment\neio step=*\n")
    step10 = str(tmp_path / "ckpt" / "step-000000000010" / "data-n0.bin")
    step11 = str(tmp_path / "ckpt" / "step-000000000011" / "data-n0.bin")
    assert [r.kind for r in rules_for(step10)] == [FaultKind.ENOSPC, FaultKind.EIO]
    assert [r.kind for r in rules_for(step11)] == [FaultKind.EIO]
    assert rules_for(str(tmp_path / "latest")) == []  # not under a step: never faulted
    with pytest.raises(ValueError, match="bad fault rule 'crash step=1'"):
        parse_rules("crash step=1")


def test_a_full_disk_writes_what_fits_then_fails_with_enospc(tmp_path) -> None:
    (tmp_path / FAULT_FILE).write_text("enospc step=3 after=10\n")
    fs, root = fsspec.core.url_to_fs(f"faulty://{tmp_path}")
    path = f"{root}/step-000000000003/data-n0.bin"
    fs.makedirs(f"{root}/step-000000000003", exist_ok=True)
    with pytest.raises(OSError) as info, fs.open(path, "wb") as f:
        f.write(b"0123456")
        f.write(b"789abcdef")
    assert info.value.errno == errno.ENOSPC
    assert (tmp_path / "step-000000000003" / "data-n0.bin").read_bytes() == b"0123456789"
    (tmp_path / FAULT_FILE).unlink()  # the disk was cleaned up: writes work again
    with fs.open(path, "wb") as f:
        f.write(b"fine")
    assert fs.cat_file(path) == b"fine"
