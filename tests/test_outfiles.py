"""Files written for the user outside a job's own directory (``peerckpt/outfiles.py``): never
through a planted link, never readable by others, whole or not at all."""

from __future__ import annotations

import os
import stat

from peerckpt.launch.campaign import Campaign, default_json_path, write_json
from peerckpt.outfiles import write_private


def test_a_link_planted_at_the_destination_is_replaced_never_followed(tmp_path) -> None:
    victim = tmp_path / "bashrc"
    victim.write_text("alias ls='ls --color'\n")
    planted = tmp_path / "peerckpt-chaos-seed7.json"
    planted.symlink_to(victim)  # what another user plants at a name they can predict
    write_private(str(planted), b'{"ok": true}')
    assert victim.read_text() == "alias ls='ls --color'\n"
    assert not planted.is_symlink() and planted.read_bytes() == b'{"ok": true}'
    assert stat.S_IMODE(planted.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bashrc", planted.name]  # no leftovers


def test_a_campaigns_outputs_go_to_a_private_directory_of_their_own(tmp_path) -> None:
    first, second = default_json_path(7, str(tmp_path)), default_json_path(7, str(tmp_path))
    assert first != second  # never a fixed name
    directory = os.path.dirname(first)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    write_json(Campaign(7, ["kill rank=1 at=3"], job_state="succeeded"), first)
    assert stat.S_IMODE(os.stat(first).st_mode) == 0o600
