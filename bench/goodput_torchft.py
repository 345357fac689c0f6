"""The torchft side of ``bench/goodput.py``: a lighthouse, one process per replica group, and
the supervisor a torchft user runs around them (torchelastic's or a cluster's restart policy).

Owns the processes of one torchft run: starts ``torchft_lighthouse`` and the replica processes
(``bench/jobs/goodput_torchft_job.py``, each its own process group), restarts a replica that
dies while the job runs, SIGKILLs a replica every ``every_s`` seconds (replica 0, 1, 2, 3, 0,
…, each only while every replica steps, as the DCP run does) and ends every process it started
on the way out, also on error. It never reads the job's model: the window and ETTR are
computed by ``goodput.py`` from the rows the replicas write.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

JOB = Path(__file__).resolve().parent / "jobs" / "goodput_torchft_job.py"
# The lighthouse as torchft's README and examples start it (min_replicas 1, a quorum tick of
# 100 ms, stragglers waited for 10 s); the heartbeat timeout, after which a silent replica
# leaves the quorum, is the binary's default.
LIGHTHOUSE = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 10000}
LIGHTHOUSE_HEARTBEAT_MS = 5000  # torchft_lighthouse's default, stated for the JSON
END_GRACE_S = 60.0  # once a replica finished, the others' time to commit the last step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"torchft_lighthouse exited ({proc.returncode}) on port {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise SystemExit(f"torchft_lighthouse did not listen on port {port} within {timeout:g} s")


def _last_row(out: Path, replica: int) -> dict[str, Any] | None:
    path = out / f"steps-rank{replica}.jsonl"
    try:
        lines = path.read_text().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None  # not written yet, or a line being written


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


class Run:
    """One torchft run: the lighthouse, ``replicas`` replica processes and their restarts."""

    def __init__(
        self, out: Path, args: list[str], replicas: int, transport: str, lighthouse: dict[str, int]
    ) -> None:
        self.out, self.args, self.replicas, self.transport = out, args, replicas, transport
        self.settings = lighthouse
        self.logs: list[IO[bytes]] = []
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.epochs = [0] * replicas
        self.finished: set[int] = set()
        self.crashes: list[dict[str, Any]] = []
        self.port = _free_port()
        self.lighthouse: subprocess.Popen[bytes] | None = None

    def _log(self, name: str) -> IO[bytes]:
        f = open(self.out / "logs" / name, "ab")  # noqa: SIM115 (closed in stop)
        self.logs.append(f)
        return f

    def start(self) -> None:
        (self.out / "logs").mkdir()
        binary = Path(sys.executable).parent / "torchft_lighthouse"
        argv = [str(binary), "--bind", f"127.0.0.1:{self.port}"]
        for key, value in self.settings.items():
            argv += [f"--{key}", str(value)]
        log = self._log("lighthouse.log")
        self.lighthouse = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        _wait_listening(self.port, self.lighthouse)
        for r in range(self.replicas):
            self._spawn(r)

    def _spawn(self, replica: int) -> None:
        argv = [sys.executable, str(JOB), str(self.out), *self.args, "--replica", str(replica)]
        argv += ["--lighthouse", f"http://127.0.0.1:{self.port}", "--epoch"]
        argv += [str(self.epochs[replica]), "--replicas", str(self.replicas)]
        argv += ["--transport", self.transport]
        env = dict(os.environ, RUST_LOG="warn")  # the managers log every quorum at info
        log = self._log(f"replica{replica}.log")
        self.procs[replica] = subprocess.Popen(
            argv, cwd=JOB.parent, env=env, stdout=log, stderr=log, start_new_session=True
        )

    def stepping_since(self, since: float) -> bool:
        """Every replica process has committed a step, begun after ``since``, in its current
        incarnation (a restarted one has healed and steps)."""
        for r in range(self.replicas):
            row = _last_row(self.out, r)
            if row is None or row["epoch"] != self.epochs[r] or row["t0"] <= since:
                return False
        return True

    def kill(self, replica: int) -> None:
        _kill_group(self.procs[replica])

    def supervise(self) -> bool:
        """Restart the replicas that died; True once every replica has ended after the job's
        last step (a replica that finished exits 0: from then on none is restarted)."""
        for r, proc in self.procs.items():
            code = proc.poll()
            if code is None or r in self.finished:
                continue
            if code == 0:
                self.finished.add(r)
            elif not self.finished:
                if code != -signal.SIGKILL:
                    self.crashes.append({"replica": r, "epoch": self.epochs[r], "code": code})
                    if len(self.crashes) > 3:
                        raise SystemExit(f"torchft replicas crashed: {self.crashes}")
                self.epochs[r] += 1
                self._spawn(r)
        if not self.finished:
            return False
        return all(p.poll() is not None for p in self.procs.values())

    def end_stragglers(self, since: float) -> list[int]:
        """After the first replica finished: a replica that has not stepped since its restart
        would form a quorum of its own and train from step 0, so it is ended at once; the
        others get END_GRACE_S to commit the last step."""
        ended = []
        for r, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            row = _last_row(self.out, r)
            joined = row is not None and row["epoch"] == self.epochs[r]
            if not joined or time.monotonic() - since > END_GRACE_S:
                _kill_group(proc)
                ended.append(r)
        return ended

    def stop(self) -> None:
        for proc in [*self.procs.values(), *([self.lighthouse] if self.lighthouse else [])]:
            _kill_group(proc)
        for proc in [*self.procs.values(), *([self.lighthouse] if self.lighthouse else [])]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        for f in self.logs:
            f.close()


def _first_row_at(out: Path, replicas: int, timeout: float = 300.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [_last_row(out, r) for r in range(replicas)]
        if any(rows):
            starts = []
            for path in out.glob("steps-rank*.jsonl"):
                with contextlib.suppress(ValueError, IndexError):
                    starts.append(json.loads(path.read_text().splitlines()[0])["t0"])
            if starts:
                return min(starts)
        time.sleep(0.05)
    raise SystemExit(f"no torchft replica committed a step in {out} within {timeout:g} s")


def run(
    out: Path,
    job_args: list[str],
    faults: int,
    every_s: float,
    replicas: int = 4,
    transport: str = "pg",
    join_timeout_ms: int = 10000,
) -> dict[str, Any]:
    """Run the torchft job to its end under ``faults`` replica kills, one every ``every_s``
    seconds from its first step; returns what the supervisor saw (kills, restarts, ends)."""
    out.mkdir()
    job = Run(
        out, job_args, replicas, transport, {**LIGHTHOUSE, "join_timeout_ms": join_timeout_ms}
    )
    kills: list[dict[str, Any]] = []
    ended: list[int] = []
    try:
        job.start()
        started = _first_row_at(out, replicas)
        deadline = time.monotonic() + 3600
        done_at = 0.0
        while not job.supervise():
            if time.monotonic() > deadline:
                raise SystemExit(f"torchft {out.name}: the job did not end within an hour")
            if job.finished:
                done_at = done_at or time.monotonic()
                ended += job.end_stragglers(done_at)
            elif len(kills) < faults and time.time() >= started + every_s * (len(kills) + 1):
                # Only while every replica steps (as the DCP run): a kill while the last one
                # heals would strike a process that has not rejoined.
                stepping = job.stepping_since(kills[-1]["at"] if kills else 0.0)
                victim = len(kills) % replicas
                if stepping:
                    kills.append({"replica": victim, "at": time.time()})
                    job.kill(victim)
            time.sleep(0.05)
    finally:
        job.stop()
    return {
        "kills": kills,
        "restarts": sum(job.epochs),
        "crashes": job.crashes,
        "ended_at_the_end": sorted(set(ended)),
        "finished": sorted(job.finished),
        "lighthouse": dict(job.settings, heartbeat_timeout_ms=LIGHTHOUSE_HEARTBEAT_MS),
        "transport": transport,
    }


def _step_ends(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Each committed step's end: the last replica's."""
    ends: dict[int, float] = {}
    for r in rows:
        ends[r["step"]] = max(ends.get(r["step"], 0.0), r["t1"])
    return ends


def summarise(
    out: Path,
    rows: list[dict[str, Any]],
    kills: list[dict[str, Any]],
    steps: int,
    warmup: int,
    world: int,
) -> dict[str, Any]:
    """What the replicas' rows and final files say: the digest, whether the replicas agree,
    the batches the window's steps trained, and per kill the survivors' pause and the time
    until the killed replica committed a step again."""
    finals = [json.loads(p.read_text()) for p in sorted(out.glob("final-rank*-e*.json"))]
    if not finals:
        raise SystemExit(f"{out.name}: no replica reached step {steps}")
    ends = _step_ends(rows)
    # A step averages the gradients of the replicas in its quorum: under a smaller quorum a
    # step trains fewer batches (the replicas' rows of a step agree; the largest is taken).
    width: dict[int, int] = {}
    for r in rows:
        width[r["step"]] = max(width.get(r["step"], 0), r["participants"])
    for k, kill in enumerate(kills):
        # the survivors' pause: the longest wait for a step's end until the next kill
        until = kills[k + 1]["at"] if k + 1 < len(kills) else float("inf")
        gaps = [
            t - ends[s - 1] for s, t in ends.items() if kill["at"] < t < until and s - 1 in ends
        ]
        kill["survivors_pause_s"] = max(gaps, default=None)
        # the killed replica's first committed step after its restart (healed, stepping)
        rejoined = [
            r["t1"] for r in rows if r["replica"] == kill["replica"] and r["t1"] > kill["at"]
        ]
        kill["rejoined_after_s"] = (min(rejoined) - kill["at"]) if rejoined else None
    discarded = sum(len(p.read_text().splitlines()) for p in out.glob("discarded-rank*.jsonl"))
    return dict(
        digest=finals[0]["digest"],
        replicas_agree=len({f["digest"] for f in finals}) == 1,
        replicas_finished=len(finals),
        faults_fired=len(kills),
        batches_in_window=sum(w for s, w in width.items() if warmup < s < steps),
        smaller_quorum_steps=sum(1 for s, w in width.items() if warmup < s < steps and w < world),
        discarded_steps=discarded,
        kills=kills,
    )


def notes(ft: dict[str, Any], every_s: float, warmup: int) -> None:
    """torchft's ETTR counted in batches beside steps, and what its figure is and is not."""
    clean, faulty = ft["clean"], ft["faults"]
    # Goodput in batches trained: a step under a smaller quorum trains fewer of them.
    ft["ettr_batches"] = (faulty["batches_in_window"] / faulty["window_s"]) / (
        clean["batches_in_window"] / clean["window_s"]
    )
    gaps = [k["survivors_pause_s"] for k in faulty["kills"] if k.get("survivors_pause_s")]
    back = [k["rejoined_after_s"] for k in faulty["kills"] if k.get("rejoined_after_s")]
    ft["survivors_pause_s_median"] = statistics.median(gaps) if gaps else None
    ft["rejoined_after_s_median"] = statistics.median(back) if back else None
    pause = (
        f"each kill paused the survivors {ft['survivors_pause_s_median']:.1f} s (median) and the "
        f"killed replica stepped again {ft['rejoined_after_s_median']:.1f} s after it; "
        if gaps and back
        else ""
    )
    ft["reason"] = pause + (
        "4 replica groups of one rank (torchft's DDP all-reduces across replica groups only, so "
        "this is the layout with the 4-rank DDP job's numerics), lighthouse min_replicas=1, "
        "the killed replica restarted by the supervisor and healed from a live one over "
        f"PGTransport; {faulty['faults_fired']} replica SIGKILLs, one per {every_s:g} s, in "
        "turn (peerckpt's schedule alternates rank and whole-node kills; a node kill here would "
        "take 2 of the 4 replica groups, so torchft gets the milder schedule). Steps are "
        "torchft's committed manager steps (the quorum's, carried to a healed replica), "
        "the same count as the others': the window runs from the end of step "
        f"{warmup} to the end of the last. They are not the same work: while a replica is "
        "lost or healing the survivors keep stepping with a smaller quorum "
        f"({faulty['smaller_quorum_steps']} of the faulty run's window steps), each such "
        "step averaging fewer batches; ettr_batches counts the batches trained instead "
        f"({ft['ettr_batches']:.3f}). bit_exact is false by design, not by fault: a smaller "
        "quorum's average is other numerics than the 4-replica run's (replicas_agree says "
        "whether the replicas ended equal to one another)."
    )
