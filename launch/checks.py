"""Every setting of a job, checked before anything starts.

One place for the rules, so that ``peerckpt run``, ``join``, ``chaos`` and ``plan`` and the
Python API (``LocalLauncher(spec)``, ``HostLauncher``, ``peerckpt.launch.ray.run(...)``)
refuse the same settings in the same words: a ``ConfigurationError`` that names the flag,
why its value cannot work, and the fix. The command line prints it and exits with status 2.

A rule belongs here when a bad value would otherwise start processes and fail later (a
heartbeat timeout of 0 declares every rank lost), fail with a library's error (an
``OverflowError`` from port 99999), or be silently ignored (``--spares`` on one host of a
multi-host job, where spares are hosts of their own). The launchers call ``check_spec``
(through ``JobSpec.check``) and ``check_host`` before they create a file, a process or a
socket; the command line adds ``check_run_flags`` for the flags that only it has.

``--replicas k`` is refused on fewer than k + 1 nodes rather than capped: every copy lives on
a node of its own, so a job that asked for k copies and got fewer would claim a protection it
does not give. (Spare nodes hold no copies: their spares hold no ranks yet. What is still
capped: the default on a one-node job, and a world that shrank under ``--min-nodes`` below
k + 1 nodes, where every remaining node keeps a copy: ``placement.effective_replicas``.)

This module never starts, opens or binds anything; it looks only at the file system (the
script, the report's folder, the files named by flags).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from peerckpt.errors import ConfigurationError
from peerckpt.names import RUN_ENV, check_job_name
from peerckpt.recovery.placement import STRATEGY_NAMES
from peerckpt.runtime.channel import HEARTBEAT_S

if TYPE_CHECKING:
    from peerckpt.launch.base import JobSpec
    from peerckpt.launch.host import HostSpec

# A rank tells its agent it is alive every HEARTBEAT_S; a timeout must outlast a missed beat.
MIN_HEARTBEAT_TIMEOUT_S = 2 * HEARTBEAT_S
# Set by the launcher for every process it starts: a value given with --env would be lost.
RESERVED_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "PEERCKPT_JOB",
        "PEERCKPT_SECRET",
        RUN_ENV,
        "PEERCKPT_AGENT",
        "PEERCKPT_NODE",
        "PEERCKPT_ROLE",
        "PEERCKPT_RESTARTS",
    }
)

# The three ways ``peerckpt run`` starts a job, and the flags that mean something in only some
# of them: flag → (the modes where it does, what to do instead elsewhere).
LOCAL, HOSTS, RAY = "local", "hosts", "ray"
_HOST_FLAGS = "--nnodes, --node-rank, --rdzv-endpoint, --node-addr, --spare-host, --secret-file"
_FOR_HOSTS = (
    "it is for one host of a job over several hosts; give it with --rdzv-endpoint HOST:PORT, "
    "--nnodes and --node-rank, or leave it out for a job on this machine"
)
_ONLY_IN: dict[str, tuple[frozenset[str], str]] = {
    "--nodes": (
        frozenset({LOCAL, RAY}),
        "on several hosts every host is a node; give their number as --nnodes",
    ),
    "--spares": (
        frozenset({LOCAL, RAY}),
        "on several hosts spares are hosts of their own; start each with --spare-host and a "
        "--node-rank of NNODES or more",
    ),
    "--keep-spares": (
        frozenset({LOCAL, RAY}),
        "on several hosts spares are hosts of their own; keep as many --spare-host hosts "
        "running as you want in reserve",
    ),
    **{flag: (frozenset({HOSTS}), _FOR_HOSTS) for flag in _HOST_FLAGS.split(", ")},
    "--nnodes": (  # as torchrun's --nnodes 1 on one machine
        frozenset({HOSTS}),
        f"{_FOR_HOSTS}, whose nodes are --nodes N (default 1)",
    ),
}
_IN_MODE = {LOCAL: "without --rdzv-endpoint", HOSTS: "with --rdzv-endpoint", RAY: "with --ray"}


def check_spec(spec: JobSpec, nodes_flag: str = "--nodes") -> None:
    """Refuse a ``JobSpec`` that cannot work; ``nodes_flag``: the flag that gave
    ``spec.nodes`` (``--nnodes`` on several hosts)."""
    if not isinstance(spec.args, list) or not all(isinstance(a, str) for a in spec.args):
        raise ConfigurationError(f"the script's arguments {spec.args!r:.80} must be strings")
    _at_least(nodes_flag, spec.nodes, 1, "a job needs at least 1 node")
    _at_least("--nproc-per-node", spec.nproc_per_node, 1, "every node runs at least 1 rank")
    _at_least("--spares", spec.spares, 0, "0 means no hot spare")
    _at_least("--max-restarts", spec.max_restarts, 0, "0 turns restarting in place off")
    if spec.replicas is not None:
        check_replicas(spec.replicas, spec.nodes, nodes_flag)
    if spec.min_nodes is not None:
        _at_least("--min-nodes", spec.min_nodes, 1, "a job keeps at least 1 node")
        if spec.min_nodes > spec.nodes:
            raise ConfigurationError(
                f"--min-nodes {spec.min_nodes} is more than the {spec.nodes} node(s) the job "
                f"starts with ({nodes_flag} {spec.nodes}): give --min-nodes from 1 to "
                f"{spec.nodes}, or more {nodes_flag}"
            )
    _seconds(
        "--heartbeat-timeout",
        spec.heartbeat_timeout,
        MIN_HEARTBEAT_TIMEOUT_S,
        f"a rank's heartbeat comes every {HEARTBEAT_S:g} s, and a shorter timeout declares "
        "healthy processes lost; the default is 5",
    )
    if spec.stall_timeout is not None:
        check_stall_timeout("--stall-timeout", spec.stall_timeout)
    _seconds("start_timeout", spec.start_timeout, 0.0, "how long the ranks get to connect")
    if spec.placement not in STRATEGY_NAMES:
        raise ConfigurationError(
            f"--placement {spec.placement!r}: choose one of {', '.join(STRATEGY_NAMES)} "
            "(docs/placement.md says what each survives)"
        )
    if spec.racks is not None:
        _check_racks(spec.racks, spec.nodes)
    if spec.erasure is not None:
        check_erasure(spec.erasure, spec.replicas, spec.nodes, nodes_flag)
    if spec.metrics_port is not None:
        _check_port(spec.metrics_port)
    if not isinstance(spec.metrics_addr, str) or not spec.metrics_addr:
        raise ConfigurationError(
            f"--metrics-addr {spec.metrics_addr!r}: give an address of this machine, e.g. "
            "127.0.0.1 (the default) or 0.0.0.0 for every interface"
        )
    if spec.report is not None:
        _check_output("--report", spec.report)
    check_env(spec.env)
    if spec.job is not None:
        check_job_name(spec.job)
    if not isinstance(spec.chaos, str):
        raise ConfigurationError(f"--chaos {spec.chaos!r:.80} must be a string of actions")
    _check_script(spec.script)  # last: a flag's problem is named even before a script exists


def check_host(spec: JobSpec, host: HostSpec) -> None:
    """Refuse what one host of a multi-host job cannot do: hold spares of its own (spare
    hosts do), or keep them in reserve; then the spec as the host runs it."""
    if spec.spares:
        raise ConfigurationError(
            f"--spares {spec.spares} {_IN_MODE[HOSTS]}: {_ONLY_IN['--spares'][1]}"
        )
    if spec.keep_spares:
        raise ConfigurationError(f"--keep-spares {_IN_MODE[HOSTS]}: {_ONLY_IN['--keep-spares'][1]}")
    check_spec(replace(spec, nodes=host.nnodes), nodes_flag="--nnodes")


def check_run_flags(given: Mapping[str, object], mode: str) -> None:
    """Refuse ``peerckpt run`` flags that mean nothing in ``mode`` (``LOCAL``, ``HOSTS`` or
    ``RAY``), or that need another flag. ``given``: every flag the user gave → its value."""
    for flag in given:
        modes, instead = _ONLY_IN.get(flag, (frozenset({mode}), ""))
        if mode in modes:
            continue
        if mode == RAY and modes == {HOSTS}:
            raise ConfigurationError(
                f"{flag} with --ray: Ray places the hosts itself; drop {_HOST_FLAGS} (use "
                "--nodes for the Ray nodes that hold ranks, --spares for spare nodes)"
            )
        raise ConfigurationError(f"{flag} {_IN_MODE[mode]}: {instead}")
    if mode == HOSTS and ("--nnodes" not in given or "--node-rank" not in given):
        raise ConfigurationError(
            "--rdzv-endpoint needs --nnodes and --node-rank on every host (the number of hosts "
            "that hold ranks, and this host's index)"
        )
    if "--keep-spares" in given and not given.get("--spares"):
        raise ConfigurationError(
            "--keep-spares keeps --spares N in reserve, and no spares were asked for: add "
            "--spares 1 (or more), or drop --keep-spares"
        )
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--secret-file"):
        path = given.get(flag)
        if isinstance(path, str) and not os.path.isfile(path):
            raise ConfigurationError(f"{flag} {path}: no such file; give the path of the file")


def check_ray_address(address: object) -> None:
    """``--ray ADDRESS``: what ``ray.init`` takes (``auto``: ``RAY_ADDRESS`` or the cluster
    started on this machine)."""
    if not isinstance(address, str) or not address.strip():
        raise ConfigurationError(
            f"--ray {address!r:.60}: give the Ray cluster's address (HOST:PORT, ray://HOST:PORT) "
            "or auto"
        )


def check_replicas(replicas: int, nodes: int, nodes_flag: str = "--nodes") -> None:
    """Refuse ``replicas`` copies of every snapshot that ``nodes`` nodes cannot hold, one
    copy per node: nothing is capped silently (the module docstring says why)."""
    _at_least("--replicas", replicas, 0, "0 means no copy on another node")
    if replicas >= nodes:
        fix = f"use --replicas {nodes - 1} or fewer" if nodes > 1 else "use --replicas 0"
        raise ConfigurationError(
            f"--replicas {replicas} needs at least {replicas + 1} nodes, since every copy "
            f"lives on a node of its own and the job has {nodes} ({nodes_flag} {nodes}); "
            f"{fix}, or more {nodes_flag}"
        )


def check_env(env: Mapping[str, str]) -> None:
    """Refuse ``--env`` variables that no process could be given, or that peerckpt sets
    itself for every process (the value would be lost)."""
    if not isinstance(env, Mapping):
        raise ConfigurationError(f"env {env!r:.80} must map variable names to values")
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ConfigurationError(
                f"--env {key!r:.60}: a variable's name is not empty and has no '=' (give "
                "--env KEY=VALUE)"
            )
        if not isinstance(value, str) or "\0" in value:
            raise ConfigurationError(f"--env {key}: its value {value!r:.60} must be a string")
        if key in RESERVED_ENV:
            raise ConfigurationError(
                f"--env {key}: peerckpt sets {key} itself for every process of the job; "
                "leave it out"
            )


def parse_env(items: Iterable[str] | None) -> dict[str, str]:
    """``--env KEY=VALUE`` (repeatable; a later KEY wins) as a map, checked."""
    env: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(
                f"--env {item!r:.60}: give KEY=VALUE, e.g. --env NCCL_DEBUG=INFO"
            )
        env[key] = value
    check_env(env)
    return env


def check_join(nproc_per_node: int | None, script: list[str] | None) -> None:
    """``peerckpt join``: the ranks it adds and the script they run, if given."""
    if nproc_per_node is not None:
        _at_least("--nproc-per-node", nproc_per_node, 1, "a node joins with at least 1 rank")
    if script:
        _check_script(script[0])


def check_plan(nodes: int, replicas: int, failures: int, state_bytes: int | None) -> None:
    """``peerckpt plan``: a placement question that has an answer."""
    _at_least("--nodes", nodes, 1, "a job needs at least 1 node")
    check_replicas(replicas, nodes)
    if not 0 <= failures <= nodes:
        raise ConfigurationError(
            f"--failures {failures}: between 0 and the {nodes} nodes can fail; "
            f"use --failures from 0 to {nodes}"
        )
    if state_bytes is not None and state_bytes < 1:
        raise ConfigurationError(f"--state-bytes {state_bytes}: a snapshot has 1 byte or more")


def check_campaign(
    faults: int, nodes: int, every: int | None, start: int, json_path: str | None = None
) -> None:
    """``peerckpt chaos``: a campaign whose faults a job can survive, and somewhere to write
    its rows (``json_path``; default: the current folder)."""
    _at_least("--faults", faults, 1, "a campaign injects at least 1 fault")
    _at_least("--nodes", nodes, 2, "a node must survive each fault")
    if every is not None:
        _at_least("--every", every, 2, "a fault's recovery needs a step of its own")
    _at_least("--start", start, 1, "a step must be committed before the first fault")
    if json_path is not None:
        _check_output("--json", json_path)


def _at_least(flag: str, value: object, least: int, why: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigurationError(f"{flag} {value!r:.40}: {why}; give {flag} {least} or more")


def check_stall_timeout(flag: str, value: object) -> float:
    """``--stall-timeout`` (or torchrun's ``PEERCKPT_STALL_TIMEOUT``): at least 1 s."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    _seconds(
        flag,
        value,
        1.0,
        "how long a rank's step may stay still, in no collective and using no CPU, before "
        "it is fenced; leave it out to only name such a rank",
    )
    return float(value)  # type: ignore[arg-type]


def _seconds(flag: str, value: object, least: float, why: str) -> None:
    """A finite number of seconds above ``least`` (above 0 when ``least`` is 0)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    seconds = float(value) if number else math.nan  # type: ignore[arg-type]
    if math.isfinite(seconds) and seconds > 0 and seconds >= least:
        return
    floor = f"at least {least:g}" if least > 0 else "a positive, finite number of"
    raise ConfigurationError(f"{flag} {value!r:.40}: give {floor} seconds ({why})")


def _check_script(script: object) -> None:
    if not isinstance(script, str) or not os.path.isfile(script):
        raise ConfigurationError(
            f"training script {script!r} does not exist (or is not a file); give its path, "
            f"relative to {os.getcwd()} or absolute"
        )


def _check_racks(racks: Mapping[int, str], nodes: int) -> None:
    ok = set(racks) == set(range(nodes)) and all(
        isinstance(r, str) and r.strip() for r in racks.values()
    )
    if not ok:
        raise ConfigurationError(
            f"--racks names {len(racks)} rack(s) for {nodes} node(s); give one non-empty name "
            "per node, in node order, e.g. --racks a,a,b,b for 4 nodes in two racks"
        )


def _check_port(port: object) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigurationError(
            f"--metrics-port {port!r:.40}: a TCP port is 0 (any free port, logged) to 65535; "
            "give e.g. --metrics-port 9464"
        )


def _check_output(flag: str, path: object) -> None:
    """A file written when the job ends: a folder that is not there would lose it after the
    whole run."""
    if not isinstance(path, str) or not path or os.path.isdir(path):
        raise ConfigurationError(f"{flag} {path!r}: give the path of a file to write")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigurationError(
            f"{flag} {path}: the folder {folder} does not exist; create it, or give a path "
            "in an existing folder"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"{flag} {path}: you cannot write in {folder}; give a path in a folder you can"
        )


def check_erasure(text: str, replicas: int | None, nodes: int, nodes_flag: str) -> None:
    """``--erasure K+M``: a code the job's nodes can hold (K + M of them, each piece of a
    stripe on a node of its own), not combined with ``--replicas``."""
    from peerckpt.coding import parse_spec

    try:
        spec = parse_spec(text)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    if replicas is not None:
        raise ConfigurationError(
            f"--erasure {spec} and --replicas {replicas} both give the job's redundancy; "
            "choose one (--erasure K+M keeps M/K of a node's state as parity, --replicas k "
            "k whole copies)"
        )
    if nodes < spec.width:
        raise ConfigurationError(
            f"--erasure {spec} puts each stripe's {spec.width} pieces on {spec.width} distinct "
            f"nodes, but the job has {nodes} ({nodes_flag} {nodes}): give {nodes_flag} "
            f"{spec.width} or more, or a smaller code (--erasure {max(1, nodes - spec.m)}+"
            f"{spec.m} needs {max(1, nodes - spec.m) + spec.m})"
        )
