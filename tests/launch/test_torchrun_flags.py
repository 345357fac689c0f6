"""``peerckpt run`` takes torchrun's spellings: ``--nproc_per_node`` as ``--nproc-per-node``
(every multi-word flag, as torchrun does), and torchrun's flags it has no use for
(``--standalone``, ``--master-addr``, ...) are refused with what to do instead, status 2,
not argparse's "unrecognized arguments"."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from peerckpt import logs
from peerckpt.launch import cli


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """What ``peerckpt run`` parsed, the job itself not started."""
    seen: list[argparse.Namespace] = []
    monkeypatch.setenv(logs.ENV, "text")  # main sets it from --log-format: undone after

    def run(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(cli, "_run", run)
    return seen


def test_underscore_spellings_are_the_same_flags(parsed: list[argparse.Namespace]) -> None:
    argv = [
        "run",
        "--nproc_per_node",
        "3",
        "--max_restarts=1",
        "--heartbeat_timeout",
        "2.5",
        "--keep_spares",
        "--spares",
        "1",
        "--node_rank",
        "0",
        "--rdzv_endpoint",
        "h:1",
        "--nnodes",
        "2",
        "--log_format",
        "json",
        "train.py",
        "--batch_size",  # the script's own flags are left as they are
        "4",
    ]
    assert cli.main(argv) == 0
    args = parsed[0]
    assert (args.nproc_per_node, args.max_restarts, args.heartbeat_timeout) == (3, 1, 2.5)
    assert args.keep_spares and (args.node_rank, args.rdzv_endpoint) == (0, "h:1")
    assert (args.nnodes, args.log_format) == (2, "json")
    assert (args.script, args.script_args) == ("train.py", ["--batch_size", "4"])


def test_every_multi_word_flag_of_every_command_has_its_underscore_spelling(
    monkeypatch: pytest.MonkeyPatch, parsed: list[argparse.Namespace]
) -> None:
    parsers: list[argparse.ArgumentParser] = []
    real = cli._underscore_spellings

    def record(parser: argparse.ArgumentParser) -> None:
        parsers.append(parser)
        real(parser)

    monkeypatch.setattr(cli, "_underscore_spellings", record)
    cli.main(["run", "train.py"])
    assert {p.prog.split()[-1] for p in parsers} >= {"run", "join", "chaos", "status"}
    checked = 0
    for parser in parsers:
        flags = parser._option_string_actions
        for option, action in list(flags.items()):
            if option.startswith("--") and "-" in option[2:]:
                assert flags[option.replace("-", "_").replace("__", "--", 1)] is action, option
                checked += 1
    assert checked > 30


def test_the_hyphen_spelling_is_what_help_shows(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    shown = capsys.readouterr().out
    assert "--nproc-per-node" in shown
    assert "--nproc_per_node" not in shown and "--standalone" not in shown


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--standalone"], "--standalone (a torchrun flag): not needed: peerckpt runs its own"),
        (["--standalone"], "peerckpt run --nodes 1 --nproc-per-node N"),
        (["--rdzv-backend", "c10d"], "--rdzv-backend (a torchrun flag): not needed"),
        (["--rdzv_backend=c10d"], "--rdzv_backend (a torchrun flag): not needed"),
        (["--rdzv-id", "7"], "give --job NAME"),
        (["--master-addr", "10.0.0.1"], "--rdzv-endpoint HOST:PORT"),
        (["--master_port", "29500"], "--master_port (a torchrun flag): not needed"),
        (["--local-addr", "10.0.0.1"], "give --node-addr ADDR"),
        (["--monitor-interval", "1"], "--heartbeat-timeout"),
        (["-m"], "give the module's file"),
        (["--tee", "3"], "redirect the command's output"),
        (["--role", "x"], "leave it out"),
    ],
)
def test_torchrun_flags_peerckpt_has_no_use_for_are_named_with_the_fix(
    parsed: list[argparse.Namespace],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", *argv, "--nproc-per-node", "2", "train.py"])
    assert exc.value.code == 2 and not parsed
    err = capsys.readouterr().err
    assert err.startswith("peerckpt: ") and message in err, err
    assert "unrecognized" not in err and "usage:" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "1:4"], "torchrun's MIN:MAX range is not taken"),
        (["--nproc_per_node", "gpu"], "torchrun's gpu/cpu/auto are not taken"),
    ],
)
def test_torchrun_forms_of_counts_are_named(
    parsed: list[argparse.Namespace],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", *argv, "train.py"])
    assert exc.value.code == 2 and not parsed
    assert message in capsys.readouterr().err


def test_nnodes_on_one_machine_names_nodes(tmp_path: Path, capsys: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    assert cli.main(["run", "--nnodes", "1", "--nproc_per_node", "2", str(script)]) == 2
    err = capsys.readouterr().err
    assert "--nnodes without --rdzv-endpoint" in err and "--nodes N (default 1)" in err
    assert list(tmp_path.iterdir()) == [script]
