"""The ``peerckpt`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from peerckpt.errors import PeerckptError


def _run(args: argparse.Namespace) -> int:
    from peerckpt.runtime.launcher import JobSpec, LocalLauncher, format_report

    spec = JobSpec(
        script=args.script,
        args=args.script_args,
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        spares=args.spares,
        replicas=args.replicas,
        chaos=args.chaos or "",
        heartbeat_timeout=args.heartbeat_timeout,
        report=args.report,
        job=args.job,
        min_nodes=args.min_nodes,
        persist=_persist(args),
    )
    result = LocalLauncher(spec).run()
    print(format_report(result), file=sys.stderr)
    return result.exit_code


def _persist(args: argparse.Namespace) -> dict[str, object] | None:
    if not args.persist:
        if args.persist_every or args.persist_interval or args.keep or args.allow_older:
            raise PeerckptError(
                "--persist-every, --persist-interval, --keep and --allow-older need --persist URL"
            )
        return None
    from peerckpt.recovery.flush import PersistConfig

    config = PersistConfig.from_settings(
        args.persist, args.persist_every, args.persist_interval, args.keep, args.allow_older
    )
    return config.to_msg()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="peerckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a training script as a local job of simulated nodes",
        description="Start a coordinator, one agent per node, the ranks and the spares on this "
        "machine; replace lost ranks with spares and recover their state from peer memory.",
    )
    run.add_argument("--nodes", type=int, default=1, help="simulated nodes (failure domains)")
    run.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    run.add_argument("--spares", type=int, default=0, help="hot spare processes, on a spare node")
    run.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="buddies per rank, on other nodes (default: the script's, else 1)",
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
        help="seconds without a heartbeat before a node is declared lost",
    )
    run.add_argument(
        "--min-nodes",
        type=int,
        default=None,
        help="let the world shrink, down to this many nodes, when no spare is left",
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
    run.add_argument("--report", default=None, help="write the job's report here as JSON")
    run.add_argument("--job", default=None, help="the job's name (default: random)")
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
        "script", nargs="?", default=None, help="the training script (default: the job's)"
    )
    join.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    insp = sub.add_parser(
        "inspect",
        help="list the durable checkpoints under a URL and verify them",
        description="Show the committed steps under URL (a path, file://, s3://, memory://), "
        "the tensors of one step, and with --verify check every chunk's checksum.",
    )
    insp.add_argument("url", help="the checkpoint root")
    insp.add_argument("--step", type=int, default=None, help="which step (default: the latest)")
    insp.add_argument("--verify", action="store_true", help="read every chunk and check it")
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
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("PEERCKPT_LOG_LEVEL", "INFO"),
        format="%(asctime)s peerckpt[launcher] %(levelname)s %(message)s",
    )
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "inspect":
            from peerckpt.persist.inspect import inspect

            lines, ok = inspect(args.url, args.step, args.verify)
            print("\n".join(lines))
            return 0 if ok else 1
        if args.command == "export":
            from peerckpt.persist.interop import export_safetensors

            tensors = export_safetensors(args.url, args.out, args.step, args.prefix)
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            print(f"wrote {len(tensors)} tensors ({total:,} bytes) to {args.out}")
            return 0
        if args.command == "join":
            from peerckpt.runtime.join import join as join_job

            script = [args.script, *args.script_args] if args.script else None
            return join_job(args.job, args.nproc_per_node, script)
    except PeerckptError as exc:
        print(f"peerckpt: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
