"""The ``peerckpt`` command line.

A note for maintainers (users read ``_DESCRIPTION`` in ``--help``): its length (~700 lines)
is the argparse declarations of every subcommand (run, join, chaos, plan, inspect, export,
status, timeline), each a flat list of options with their help, and one short handler per
subcommand that calls into ``launch/``; it holds no logic a split would make clearer.
The rules a flag's value must meet are in ``launch/checks.py``, shared with the Python API.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

from peerckpt import logs
from peerckpt.errors import CheckpointError, PeerckptError
from peerckpt.recovery.placement import STRATEGY_NAMES


def _run(args: argparse.Namespace) -> int:
    from peerckpt.launch import checks
    from peerckpt.launch.base import JobSpec
    from peerckpt.launch.local import LocalLauncher
    from peerckpt.launch.report import format_report
    from peerckpt.replication.nccl import check_transport
    from peerckpt.replication.transport import ENV as TRANSPORT_ENV
    from peerckpt.tls import use_files

    mode = (
        checks.RAY
        if args.ray is not None
        else checks.HOSTS
        if args.rdzv_endpoint is not None
        else checks.LOCAL
    )
    checks.check_run_flags(_given(args), mode)  # the launcher checks the JobSpec itself
    use_files(args.tls_cert, args.tls_key, args.tls_ca)  # inherited by every process started
    # How recovery pulls travel, for every agent started (nccl refused here without CuPy/CUDA).
    os.environ[TRANSPORT_ENV] = check_transport(args.transport).value
    spec = JobSpec(
        script=args.script,
        args=args.script_args,
        nodes=1 if args.nodes is None else args.nodes,
        nproc_per_node=args.nproc_per_node,
        spares=args.spares or 0,
        keep_spares=args.keep_spares,
        replicas=args.replicas,
        chaos=args.chaos or "",
        heartbeat_timeout=args.heartbeat_timeout,
        stall_timeout=args.stall_timeout,
        report=args.report,
        job=args.job,
        min_nodes=args.min_nodes,
        max_restarts=args.max_restarts,
        persist=_persist(args),
        placement=args.placement,
        racks=_racks(args.racks),
        erasure=args.erasure,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        env=checks.parse_env(args.env),
    )
    if args.ray is not None:
        result = _ray_launcher(args, spec).run()
    elif args.rdzv_endpoint is None:
        result = LocalLauncher(spec).run()
    else:
        result = _host_launcher(args, spec).run()
    print(format_report(result), file=sys.stderr)
    return result.exit_code


# Flags of `peerckpt run` that mean something in only some of its modes (``checks._ONLY_IN``).
_MODE_FLAGS = (
    "nodes",
    "spares",
    "keep_spares",
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "node_addr",
    "spare_host",
    "secret_file",
    "tls_cert",
    "tls_key",
    "tls_ca",
)


def _given(args: argparse.Namespace) -> dict[str, object]:
    """The mode-dependent flags the user gave (left at None or False: not given) → values."""
    values = {f"--{name.replace('_', '-')}": getattr(args, name) for name in _MODE_FLAGS}
    return {flag: v for flag, v in values.items() if v is not None and v is not False}


def _host_launcher(args: argparse.Namespace, spec: Any) -> Any:
    """This host's launcher of a multi-host job (``launch/host.py``)."""
    from peerckpt.launch.addr import node_address
    from peerckpt.launch.host import HostLauncher, HostSpec
    from peerckpt.secret import job_secret

    rdzv_host = args.rdzv_endpoint.rpartition(":")[0]
    host = HostSpec(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        node_addr=args.node_addr or node_address(rdzv_host),
        spare_host=args.spare_host,
    )
    return HostLauncher(spec, host, job_secret(args.secret_file))


def _ray_launcher(args: argparse.Namespace, spec: Any) -> Any:
    """The driver of a job on a Ray cluster (``launch/ray.py``)."""
    try:
        from peerckpt.launch.ray import RayLauncher
    except ImportError as exc:
        raise PeerckptError(f"--ray needs Ray: pip install 'peerckpt[ray]' ({exc})") from None
    return RayLauncher(spec, args.ray)


def _chaos(args: argparse.Namespace) -> int:
    from peerckpt.launch.base import JobSpec
    from peerckpt.launch.campaign import default_json_path, format_table, run_campaign, write_json
    from peerckpt.launch.checks import check_campaign
    from peerckpt.outfiles import write_private

    check_campaign(args.faults, args.nodes, args.every, args.start, args.json)
    JobSpec(  # the chaos run's settings, checked as `peerckpt run` checks them
        script=args.script,
        args=args.script_args,
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        spares=args.spares,
        replicas=args.replicas,
        heartbeat_timeout=args.heartbeat_timeout,
        job=f"{args.job}_chaos" if args.job else None,
    ).check()
    campaign = run_campaign(
        [args.script, *args.script_args],
        args.seed,
        args.faults,
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        spares=args.spares,
        start=args.start,
        every=args.every,
        heartbeat_timeout=args.heartbeat_timeout,
        replicas=args.replicas,
        job=args.job,
        progress=True,
        ray=args.ray,
    )
    path = args.json or default_json_path(args.seed, args.out or os.path.dirname(args.script))
    write_json(campaign, path)
    print(format_table(campaign))
    print(f"written to {path}")
    if campaign.result is not None:
        from peerckpt.launch.timeline import timeline

        stem = path[:-5] if path.endswith(".json") else path
        report, picture = f"{stem}-report.json", f"{stem}-timeline.png"
        write_private(report, json.dumps(campaign.result.to_json(), indent=1, default=str))
        timeline(report, picture)
        print(f"the chaos run's report: {report}; its timeline: {picture}")
    return 0 if campaign.ok else 1


def _status(args: argparse.Namespace) -> int:
    from peerckpt.launch.console import status

    if args.interval <= 0:
        raise PeerckptError(f"--interval {args.interval}: give a positive number of seconds")
    return status(
        args.job, args.rdzv_endpoint, args.secret_file, args.once, args.json, args.interval
    )


def _timeline(args: argparse.Namespace) -> int:
    from peerckpt.launch.timeline import timeline

    data = timeline(args.report, args.out, args.data)
    print(f"wrote {args.out}: {len(data['faults'])} fault(s), {len(data['ranks'])} rank(s)")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from peerckpt.launch.progress import Report, callback
    from peerckpt.persist.inspect import inspect

    with Report("verifying", None, "chunks", delay_s=1.0) as report, _reading(args.url):
        lines, ok = inspect(args.url, args.step, args.verify, args.tensors, callback(report))
    print("\n".join(lines))
    return 0 if ok else 1


def _export(args: argparse.Namespace) -> int:
    from peerckpt.launch.progress import Report, callback
    from peerckpt.persist.durable import DurableStore
    from peerckpt.persist.interop import export_safetensors, per_rank_tensors

    with (
        Report(f"exporting to {args.out}", None, "tensors", delay_s=1.0) as report,
        _reading(args.url),
    ):
        tensors = export_safetensors(args.url, args.out, args.step, args.prefix, callback(report))
        own = per_rank_tensors(DurableStore(args.url).open(args.step), args.prefix)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"wrote {len(tensors)} tensors ({total:,} bytes) to {args.out}")
    if own:
        print(
            f"left out: {len(own)} per-rank tensor(s), each rank's own, not parts of a full "
            f"tensor ({', '.join(own[:3])}{', …' if len(own) > 3 else ''})"
        )
    return 0


@contextlib.contextmanager
def _reading(url: str) -> Iterator[None]:
    """What the storage under ``url`` raised while read (refused, unreachable), as an error
    of the command that names the URL, not a traceback."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"cannot read {url}: {exc}") from None


def _racks(text: str | None) -> dict[int, str] | None:
    """``--racks a,a,b,b``: the rack of node 0, 1, 2, … (the spare node is a rack of its own;
    ``JobSpec.check`` wants one per node)."""
    if not text:
        return None
    return dict(enumerate(r.strip() for r in text.split(",")))


def _persist(args: argparse.Namespace) -> dict[str, object] | None:
    if not args.persist:
        if (
            args.persist_every
            or args.persist_interval
            or args.keep
            or args.allow_older
            or args.persist_mode
        ):
            raise PeerckptError(
                "--persist-every, --persist-interval, --keep, --allow-older and --persist-mode "
                "need --persist URL"
            )
        return None
    from peerckpt.persist.config import PersistConfig

    config = PersistConfig.from_settings(
        args.persist,
        args.persist_every,
        args.persist_interval,
        args.keep,
        args.allow_older,
        _mode(args.persist_mode),
    )
    return config.to_msg()  # its location is probed by JobSpec.check, before anything starts


def _mode(text: str | None) -> int | None:
    """``--persist-mode 0640``: permission bits in octal."""
    if text is None:
        return None
    try:
        return int(text, 8)
    except ValueError:
        raise PeerckptError(
            f"--persist-mode {text!r} is not an octal mode; give e.g. 0600 (the default) or 0640"
        ) from None


def _plan(args: argparse.Namespace) -> int:
    from peerckpt.launch.checks import check_plan
    from peerckpt.recovery.survival import plan

    if args.erasure is not None:
        return _plan_erasure(args)
    if args.replicas is None:
        from peerckpt.errors import ConfigurationError

        raise ConfigurationError("peerckpt plan: give --replicas k (buddy copies) or --erasure K+M")
    check_plan(args.nodes, args.replicas, args.failures, args.state_bytes)
    names = STRATEGY_NAMES if args.strategy == "all" else (args.strategy,)
    plans = plan(args.nodes, args.replicas, args.failures, names)
    size = args.state_bytes
    if args.json:
        out = {
            "nodes": args.nodes,
            "replicas": args.replicas,
            "failures": args.failures,
            "failure_sets": plans[0].failure_sets,
            "state_bytes": size,
            "strategies": [
                {
                    "strategy": p.strategy,
                    "recoverable_sets": p.recoverable_sets,
                    "probability": str(p.probability),
                    "percent": float(p.probability * 100),
                    "memory_per_node_most": p.memory.most,
                    "memory_per_node_least": p.memory.least,
                    "memory_per_node_mean": str(p.memory.mean),
                    "bytes_per_node_most": None if size is None else p.memory.most * size,
                }
                for p in plans
            ],
        }
        print(json.dumps(out, indent=2))
        return 0
    from peerckpt.units import human

    print(
        f"{args.nodes} nodes, {args.replicas} replica(s) per snapshot ({args.replicas + 1} "
        f"copies), {args.failures} simultaneous node failure(s): {plans[0].failure_sets:,} "
        "equally likely sets of failed nodes"
    )
    size_text = "" if size is None else f" = {size:,} bytes ({human(size)})"
    print(f"S = one node's snapshot{size_text}")
    rows = [("strategy", "recoverable sets", "probability", "percent", "memory per node")]
    for p in plans:
        memory = f"{p.memory.most}·S"
        if size is not None:
            memory += f" = {p.memory.most * size:,} bytes ({human(p.memory.most * size)})"
        if p.memory.least != p.memory.most:
            memory = f"up to {memory} (least {p.memory.least}·S, mean {p.memory.mean}·S)"
        recoverable = f"{p.recoverable_sets:,}/{p.failure_sets:,}"
        rows.append((p.strategy, recoverable, str(p.probability), _percent(p.probability), memory))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)),
            row[4],
            sep="  ",
        )
    return 0


def _plan_erasure(args: argparse.Namespace) -> int:
    """``peerckpt plan --erasure K+M``: what the groups survive, and a node's memory."""
    from peerckpt.coding import parse_spec
    from peerckpt.launch.checks import check_erasure, check_plan
    from peerckpt.recovery.erasure import erasure_plan

    check_erasure(args.erasure, args.replicas, args.nodes, "--nodes")
    check_plan(args.nodes, 0, args.failures, args.state_bytes)
    p = erasure_plan(args.nodes, parse_spec(args.erasure), args.failures)
    size = args.state_bytes
    if args.json:
        out = {
            "nodes": args.nodes,
            "erasure": str(p.spec),
            "failures": args.failures,
            "groups": list(p.groups),
            "failure_sets": p.failure_sets,
            "recoverable_sets": p.recoverable_sets,
            "probability": str(p.probability),
            "percent": float(p.probability * 100),
            "memory_per_node_most": str(p.memory_most),
            "memory_per_node_least": str(p.memory_least),
            "bytes_per_node_most": None if size is None else int(p.memory_most * size),
        }
        print(json.dumps(out, indent=2))
        return 0
    from peerckpt.units import human

    print(
        f"{args.nodes} nodes, erasure {p.spec} (groups of {', '.join(map(str, p.groups))} "
        f"nodes, each surviving any {p.spec.m} of its nodes lost), {args.failures} "
        f"simultaneous node failure(s): {p.failure_sets:,} equally likely sets of failed nodes"
    )
    memory = f"{p.memory_most}·S"
    if size is not None:
        memory += f" = {int(p.memory_most * size):,} bytes ({human(int(p.memory_most * size))})"
    if p.memory_least != p.memory_most:
        memory = f"up to {memory} (least {p.memory_least}·S)"
    print(f"S = one node's snapshot; memory per node (own copy + parity): {memory}")
    print(
        f"recoverable sets {p.recoverable_sets:,}/{p.failure_sets:,}  probability "
        f"{p.probability}  {_percent(p.probability)}"
    )
    return 0


def _percent(p: Fraction) -> str:
    """Percent to 4 decimals; only a certainty prints as 100% and only an impossibility as 0%."""
    units = math.floor(p * 10**6 + Fraction(1, 2))
    # Rounding must not turn a near-certainty into a certainty, nor a slim chance into none.
    if p < 1:
        units = min(units, 10**6 - 1)
    if p > 0:
        units = max(units, 1)
    return f"{units // 10**4}.{units % 10**4:04d}%"


# torchrun's flags that ``peerckpt run`` does not have → (takes a value, why none is needed
# or what to give instead); refused by ``_TorchrunOnly``.
_RDZV = (
    "peerckpt runs its own rendezvous; a job on this machine needs no rendezvous flags "
    "(peerckpt run --nodes 1 --nproc-per-node N train.py), on several hosts give every host "
    "--rdzv-endpoint HOST:PORT (host 0's coordinator), --nnodes and --node-rank"
)
_OUTPUT = (
    "not needed: every process's output comes out of this command, each log line naming its "
    "rank (peerckpt[rank=N …]); redirect the command's output to keep it in a file"
)
_TORCHRUN_ONLY: dict[tuple[str, ...], tuple[bool, str]] = {
    ("--standalone",): (False, f"not needed: {_RDZV}"),
    ("--rdzv-backend",): (True, f"not needed: {_RDZV}"),
    ("--rdzv-conf",): (True, f"not needed: {_RDZV}"),
    ("--rdzv-id",): (True, "not needed: peerckpt names the job; give --job NAME to choose it"),
    ("--master-addr",): (True, f"not needed: {_RDZV}"),
    ("--master-port",): (True, f"not needed: {_RDZV}"),
    ("--local-addr",): (True, "give --node-addr ADDR (the address this host's agent binds)"),
    ("--monitor-interval",): (
        True,
        "not needed: a node is declared lost after --heartbeat-timeout SECONDS without a heartbeat",
    ),
    ("--start-method",): (True, "not needed: peerckpt starts every rank as a process of its own"),
    ("-m", "--module"): (
        False,
        "peerckpt run starts a script by its path: give the module's file (e.g. pkg/train.py)",
    ),
    ("--no-python",): (False, "peerckpt run starts a Python script: give its path"),
    ("--run-path",): (False, "not needed: peerckpt run starts the script by its path"),
    ("--log-dir",): (True, _OUTPUT),
    ("-r", "--redirects"): (True, _OUTPUT),
    ("-t", "--tee"): (True, _OUTPUT),
    ("--local-ranks-filter",): (True, _OUTPUT),
    ("--duplicate-stdout-filters",): (True, _OUTPUT),
    ("--duplicate-stderr-filters",): (True, _OUTPUT),
    **{
        (flag,): (value, "peerckpt run has no such setting; leave it out")
        for flag, value in (
            ("--role", True),
            ("--event-log-handler", True),
            ("--logs-specs", True),
            ("--numa-binding", True),
            ("--signals-to-handle", True),
            ("--shutdown-timeout", True),
            ("--virtual-local-rank", False),
        )
    },
}


class _TorchrunOnly(argparse.Action):
    """A torchrun flag given to ``peerckpt run``: refused as every flag is (one line, the
    fix, status 2), not with argparse's "unrecognized arguments"; not listed in ``--help``."""

    def __init__(self, option_strings: list[str], dest: str, why: str, value: bool) -> None:
        super().__init__(
            option_strings,
            argparse.SUPPRESS,
            nargs="?" if value else 0,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
        self.why = why

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.exit(2, f"peerckpt: {option_string} (a torchrun flag): {self.why}\n")


def _torchrun_flags(run: argparse.ArgumentParser) -> None:
    for flags, (value, why) in _TORCHRUN_ONLY.items():
        run.add_argument(*flags, action=_TorchrunOnly, why=why, value=value)


def _underscore_spellings(parser: argparse.ArgumentParser) -> None:
    """Accept ``--nproc_per_node`` for ``--nproc-per-node``, and so for every multi-word
    flag, as torchrun does: the same flag (same dest), not listed again in ``--help``."""
    for action in list(parser._actions):
        for option in action.option_strings:
            alias = "--" + option[2:].replace("-", "_")
            if option.startswith("--") and alias not in parser._option_string_actions:
                parser._option_string_actions[alias] = action


def _count(flag: str) -> Any:
    """The type of an ``int`` flag that torchrun also takes in other forms (``--nnodes
    1:4``, ``--nproc-per-node gpu``): those are named with what peerckpt takes instead."""
    instead = {
        "--nnodes": "torchrun's MIN:MAX range is not taken: give the hosts the job starts "
        "with as --nnodes N, and --min-nodes MIN to let it shrink to MIN when no spare is left",
        "--nproc-per-node": "torchrun's gpu/cpu/auto are not taken: give the number of ranks "
        "per node",
    }[flag]

    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; {instead}") from None

    return parse


_DESCRIPTION = """\
Peer-replicated, in-memory checkpointing for PyTorch training: a lost rank or node is
recovered from the memory of healthy peers, and training goes on from the last committed
step. `peerckpt run train.py` starts a job; `peerckpt COMMAND --help` says more.
Every flag is checked before anything starts: a bad one exits with status 2 and the fix."""


def _version() -> str:
    """The installed package's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("peerckpt")
    except PackageNotFoundError:
        from peerckpt import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="peerckpt",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"peerckpt {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a training script as a job: on this machine, on several hosts, or on Ray",
        description="Start a coordinator, one agent per node, the ranks and the spares (on this "
        "machine as simulated nodes; with --rdzv-endpoint this host's share of a job over "
        "several hosts; with --ray on a Ray cluster); replace lost ranks with spares and "
        "recover their state from peer memory. Every flag is checked before anything starts "
        "(docs/flags.md).",
    )
    run.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="simulated nodes, the failure domains (default 1; under --ray: Ray nodes with "
        "ranks; on several hosts give --nnodes instead)",
    )
    run.add_argument(
        "--nproc-per-node", type=_count("--nproc-per-node"), default=1, help="ranks per node (≥ 1)"
    )
    run.add_argument(
        "--spares",
        type=int,
        default=None,
        help="hot spare processes, on a spare node (default 0; under --ray: spare Ray nodes; "
        "on several hosts start --spare-host hosts instead)",
    )
    run.add_argument(
        "--keep-spares",
        action="store_true",
        help="keep --spares in reserve, as a cluster's pool of hot spares: start a new spare "
        "(on a fresh spare node once the last one runs ranks) for every one used or lost "
        "(a local job; under --ray spare nodes are always replenished)",
    )
    run.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="buddies per rank, on other nodes: fewer than --nodes, since each copy lives on a "
        "node of its own (default: the script's, else 1, fewer on fewer nodes)",
    )
    run.add_argument(
        "--chaos",
        default=None,
        help="faults to inject, e.g. 'kill rank=2 at=30; kill node=1 at=60'",
    )
    run.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=5.0,
        help="seconds without a heartbeat before a node is declared lost (≥ 0.5)",
    )
    run.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fence and recover a rank whose step has not moved for this long while it waits "
        "in no collective and uses no CPU (a DataLoader that never delivers, a hung read); "
        "default: such a rank is named with its stacks after 120 s or 30 of its usual steps, "
        "whichever is longer, not fenced",
    )
    run.add_argument(
        "--placement",
        choices=("ring", "group", "mixed"),
        default="ring",
        help="how buddies are chosen (see `peerckpt plan` for what each survives)",
    )
    run.add_argument(
        "--racks",
        default=None,
        metavar="R0,R1,…",
        help="the rack of each node, in node order: copies go to distinct racks where possible",
    )
    run.add_argument(
        "--erasure",
        default=None,
        metavar="K+M",
        help="erasure-coded redundancy instead of replicas: groups of K+M nodes survive any "
        "M of them lost together, for M/K of a node's state in parity (docs/erasure.md)",
    )
    run.add_argument(
        "--min-nodes",
        type=int,
        default=None,
        help="let the world shrink, down to this many nodes (1 … --nodes), when no spare is left",
    )
    run.add_argument(
        "--transport",
        choices=["auto", "tcp", "nccl"],
        default="auto",
        help="how a replacement's state is pulled from a peer agent: auto (the default) uses "
        "NCCL where both agents have CUDA and NCCL (peerckpt[gpu]), TCP otherwise and as the "
        "fallback; nccl is refused on a host without them",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="with no spare free, restart a rank process that died on a healthy node there, "
        "from its node's memory, up to N times per rank (default 3, as torchrun; 0: never)",
    )
    run.add_argument(
        "--persist",
        default=None,
        metavar="URL",
        help="write committed steps to durable storage here in the background "
        "(a path, file://, s3://; default: the script's @resilient(persist=…), else none)",
    )
    run.add_argument(
        "--persist-every", type=int, default=None, help="flush every N steps (default 100)"
    )
    run.add_argument("--persist-interval", type=float, default=None, help="flush every S seconds")
    run.add_argument("--keep", type=int, default=None, help="committed checkpoints to keep")
    run.add_argument(
        "--allow-older",
        action="store_true",
        help="on a cold start, verify the latest checkpoint first and fall back to older "
        "committed steps if it is damaged",
    )
    run.add_argument(
        "--persist-mode",
        default=None,
        metavar="OCTAL",
        help="permission bits of the durable files written to local storage (default 0600; "
        "directories get the matching 0700)",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at /metrics and a status page at /status on this port "
        "(0: any free port, logged)",
    )
    run.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="the address the metrics listen on (default loopback; 0.0.0.0 for every interface)",
    )
    run.add_argument(
        "--env",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="set this variable for every process of the job, on every node (repeatable; over "
        "the launching environment, which --ray forwards less what names this machine: "
        "docs/ray.md)",
    )
    run.add_argument(
        "--report", default=None, help="write the job's report here as JSON (its folder must exist)"
    )
    for name in ("cert", "key", "ca"):
        run.add_argument(
            f"--tls-{name}", default=None, help=f"TLS {name} (PEM; default: derived per job)"
        )
    run.add_argument("--job", default=None, help="the job's name (default: random)")
    hosts = run.add_argument_group(
        "several hosts",
        "run the same command on every host (as with torchrun): host 0 runs the coordinator at "
        "--rdzv-endpoint; the secret comes from PEERCKPT_SECRET or --secret-file",
    )
    hosts.add_argument(
        "--nnodes", type=_count("--nnodes"), default=None, help="hosts that hold the job's ranks"
    )
    hosts.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this host's index: 0 … NNODES-1 hold ranks; NNODES or more: a spare host "
        "(--spare-host) or a host that grows the job",
    )
    hosts.add_argument(
        "--rdzv-endpoint", default=None, metavar="HOST:PORT", help="the coordinator, on host 0"
    )
    hosts.add_argument(
        "--node-addr",
        default=None,
        metavar="ADDR",
        help="the address this host's agent binds and announces (env PEERCKPT_NODE_ADDR; "
        "default: the address of the interface that reaches the rendezvous endpoint)",
    )
    hosts.add_argument(
        "--spare-host", action="store_true", help="hold --nproc-per-node hot spares for the job"
    )
    hosts.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help="the job's secret in hex, a file only you can read (default: PEERCKPT_SECRET)",
    )
    run.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run on the Ray cluster at ADDRESS (auto: RAY_ADDRESS): one host per Ray node, "
        "--nodes of them with ranks, --spares spare nodes (docs/ray.md)",
    )
    _torchrun_flags(run)
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    join = sub.add_parser(
        "join",
        help="add a node to a job running on this machine",
        description="Start one more node (an agent and its ranks) for a running job; the world "
        "grows to include it and every rank restores the last committed step into the new layout.",
    )
    join.add_argument("--job", required=True, help="the running job's name")
    join.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks on the new node (default: as many as the job's nodes have)",
    )
    join.add_argument(
        "--env",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="set this variable for the new node's processes (repeatable; over the job's "
        "own --env)",
    )
    join.add_argument(
        "script", nargs="?", default=None, help="the training script (default: the job's)"
    )
    join.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    insp = sub.add_parser(
        "inspect",
        help="list the durable checkpoints under a URL and verify them",
        description="Show the committed steps under URL (a path, file://, s3://, memory://) "
        "and a summary of one step; --tensors lists its tensors, --verify checks every "
        "chunk's checksum.",
    )
    insp.add_argument("url", help="the checkpoint root")
    insp.add_argument("--step", type=int, default=None, help="which step (default: the latest)")
    insp.add_argument("--verify", action="store_true", help="read every chunk and check it")
    insp.add_argument(
        "--tensors", action="store_true", help="list every tensor (default: a summary)"
    )
    exp = sub.add_parser(
        "export",
        help="write the full tensors of a durable checkpoint to another format",
        description="Assemble every shared tensor of a committed step (all shards) and write "
        "them to one file, e.g. for evaluation or Hugging Face tooling.",
    )
    exp.add_argument("url", help="the checkpoint root")
    exp.add_argument("--to", choices=["safetensors"], default="safetensors", help="the format")
    exp.add_argument("--out", required=True, help="the file to write")
    exp.add_argument("--step", type=int, default=None, help="which step (default: the latest)")
    exp.add_argument(
        "--prefix",
        default=None,
        help="only this tracked object's tensors, named as in its state_dict (e.g. model)",
    )
    plan = sub.add_parser(
        "plan",
        help="compare buddy placements: odds of surviving node failures, memory per node",
        description="For n nodes, k replicas and f nodes failing at once (every set of f "
        "equally likely), print each placement strategy's exact probability that every "
        "snapshot still has a copy in memory, and the snapshot memory a node must hold.",
    )
    plan.add_argument("--nodes", type=int, required=True, help="nodes (failure domains)")
    plan.add_argument("--replicas", type=int, default=None, help="buddies per snapshot, as in run")
    plan.add_argument(
        "--erasure",
        default=None,
        metavar="K+M",
        help="instead of --replicas: what groups of K+M nodes with M parity pieces survive",
    )
    plan.add_argument("--failures", type=int, required=True, help="nodes failing at once")
    plan.add_argument(
        "--strategy",
        choices=[*STRATEGY_NAMES, "all"],
        default="all",
        help="which placement (default: all)",
    )
    plan.add_argument(
        "--state-bytes",
        type=int,
        default=None,
        metavar="N",
        help="one node's snapshot size, to print memory in bytes",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    chaos = sub.add_parser(
        "chaos",
        help="run a script under a seeded random sequence of faults and check it bit for bit",
        description="Run the script once without faults and once under --faults random faults "
        "(kills of ranks, nodes and agents, hangs, partitions, slow links, corrupt replicas, "
        "kills during a snapshot, a replication or a recovery), one every --every steps; print "
        "a row per fault and compare every snapshot with the fault-free run.",
    )
    chaos.add_argument("--seed", type=int, required=True, help="the random sequence's seed")
    chaos.add_argument("--faults", type=int, required=True, help="how many faults")
    chaos.add_argument("--nodes", type=int, default=3, help="simulated nodes")
    chaos.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    chaos.add_argument("--spares", type=int, default=2, help="spares kept in reserve")
    chaos.add_argument("--replicas", type=int, default=None, help="buddies per snapshot")
    chaos.add_argument("--start", type=int, default=5, help="the first fault's step")
    chaos.add_argument(
        "--every",
        type=int,
        default=None,
        help="steps between faults (default: spread evenly over the fault-free run's steps)",
    )
    chaos.add_argument("--heartbeat-timeout", type=float, default=3.0, help="seconds")
    chaos.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="run both jobs on this Ray cluster (auto: RAY_ADDRESS): --nodes Ray nodes hold "
        "ranks, --spares counts spare Ray nodes (docs/ray.md)",
    )
    chaos.add_argument(
        "--json",
        default=None,
        help="where to write the rows as JSON (default: campaign.json in a new private "
        "directory under --out)",
    )
    chaos.add_argument(
        "--out",
        default=None,
        help="the directory that holds the campaign's outputs (default: the script's)",
    )
    chaos.add_argument("--job", default=None, help="name the two jobs NAME_ref and NAME_chaos")
    chaos.add_argument("script", help="the training script (it must run long enough)")
    chaos.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    stat = sub.add_parser(
        "status",
        help="show a running job: nodes, ranks and their copies, steps, lag, recoveries",
        description="A live view of a running job (until it ends or Ctrl-C): its nodes and "
        "their health and memory, every rank and the nodes holding its committed copy, the "
        "committed and durable steps, replication lag, spares, and the last recoveries with "
        "their cost.",
    )
    stat.add_argument("--job", required=True, help="the running job's name")
    stat.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="the job's coordinator (a job on other machines); the secret comes from "
        "PEERCKPT_SECRET or --secret-file",
    )
    stat.add_argument(
        "--secret-file", default=None, metavar="PATH", help="the job's secret in hex (mode 0600)"
    )
    stat.add_argument("--once", action="store_true", help="print one snapshot as text and exit")
    stat.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    stat.add_argument("--interval", type=float, default=1.0, help="seconds between redraws")
    tl = sub.add_parser(
        "timeline",
        help="draw a job's report: every rank's steps over time and what each fault cost",
        description="Draw REPORT.json (from `peerckpt run --report`) as a PNG: each rank's step "
        "over wall-clock time, the committed step, faults, recoveries and durable flushes, "
        "and per fault its cost split into detection, transfer and restore.",
    )
    tl.add_argument("report", help="the job's report (peerckpt run --report PATH)")
    tl.add_argument("-o", "--out", required=True, help="the PNG to write")
    tl.add_argument("--data", default=None, help="also write the drawn data here as JSON")
    for p in sub.choices.values():
        p.add_argument(
            "--log-format",
            choices=logs.FORMATS,
            default=None,
            help="log records as text (default) or one JSON object per line, in every process "
            "of the job",
        )
        _underscore_spellings(p)  # as torchrun: --nproc_per_node is --nproc-per-node
    args = parser.parse_args(argv)
    if args.log_format is not None:
        os.environ[logs.ENV] = args.log_format  # the job's processes inherit it
    logs.configure("launcher", "%(asctime)s peerckpt[launcher] %(levelname)s %(message)s")
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "export":
            return _export(args)
        if args.command == "status":
            return _status(args)
        if args.command == "timeline":
            return _timeline(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "chaos":
            return _chaos(args)
        if args.command == "join":
            from peerckpt.launch.checks import parse_env
            from peerckpt.launch.join import join as join_job

            script = [args.script, *args.script_args] if args.script else None
            return join_job(args.job, args.nproc_per_node, script, parse_env(args.env))
    except PeerckptError as exc:
        print(f"peerckpt: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
