"""The seeded fault sequence of a chaos campaign on Ray (``peerckpt chaos --ray``).

Pure: no Ray, no processes. Under Ray a fault is fired by the host it strikes
(``launch/rayplan.split_chaos``), which brings rules the local sequence does not
need, so this one keeps them while drawing:

* a rank is struck at most once (its host strikes it by pid, on its own machine; after a
  first fault the rank may live on another host), and not after its host was lost;
* whole-node faults (``kill node``, ``kill agent``) strike hosts 1 … nodes-1, each once:
  host 0 is Ray's head and runs the coordinator, and a Ray cluster does not outlive its head;
* node faults name host numbers (``node=N``), not ``node=@R``: the driver splits the spec
  before the job starts;
* no ``during=PHASE`` on a whole node (not available under Ray), no fault timed inside
  another's recovery, no ``corrupt`` (it flips the replicas in the shared memory of the
  machine that fires it, and a rank's buddies are on other machines);
* the ranks lost (killed, hung past the heartbeat, their node or agent killed) never exceed
  the spare slots (spare nodes × ranks per node): a job short of spares shrinks, and a
  shrunk world cannot be compared bit for bit with the reference.

It must never draw a sequence ``split_chaos`` refuses (``tests/chaos/test_raysched.py``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from peerckpt.errors import ConfigurationError

# name, weight, clause template; {r} a rank, {n} a host, {s} the step, {hang} seconds
_RANK = [
    ("kill rank", 3, "kill rank={r} at={s}"),
    ("hang", 2, "hang rank={r} at={s} for={hang}"),
    ("kill during snapshot", 2, "kill rank={r} at={s} during=snapshot"),
]
_NODE_LOSS = [
    ("kill node", 3, "kill node={n} at={s}"),
    ("kill agent", 2, "kill agent node={n} at={s}"),
]
_HARMLESS = [
    ("partition, short", 1, "partition node={n} at={s} for=0.3"),
    ("slow", 1, "slow node={n} at={s} rate=2 for=2"),
    ("kill coordinator", 1, "kill coordinator at={s}"),
]


@dataclass
class _Board:
    """What the faults drawn so far leave to strike."""

    nodes: int
    nproc: int
    spare_slots: int
    struck: set[int] = field(default_factory=set)  # ranks: each once
    dead: set[int] = field(default_factory=set)  # hosts whose ranks were lost whole
    lost: int = 0

    def ranks(self) -> list[int]:
        return [
            r
            for r in range(self.nodes * self.nproc)
            if r not in self.struck and r // self.nproc not in self.dead
        ]

    def hosts(self) -> list[int]:
        return [n for n in range(self.nodes) if n not in self.dead]

    def on(self, host: int) -> list[int]:
        """Ranks still on ``host`` (those struck before moved to a spare node)."""
        return [
            r for r in range(host * self.nproc, (host + 1) * self.nproc) if r not in self.struck
        ]


def generate_ray(
    seed: int,
    faults: int,
    nodes: int,
    nproc: int,
    spare_nodes: int,
    start: int,
    every: int,
    heartbeat_s: float,
) -> list[str]:
    """``faults`` fault clauses for a job of ``nodes`` hosts × ``nproc`` ranks with
    ``spare_nodes`` spare hosts, one every ``every`` steps from ``start``. When no rank or
    node is left that the rules allow to lose, the faults that lose nothing are drawn
    (a short partition, a slowed link, the coordinator killed: it restarts in place)."""
    rng = random.Random(seed)
    board = _Board(nodes, nproc, spare_nodes * nproc)
    hang = round(heartbeat_s + 2.0, 1)
    clauses: list[str] = []
    step = start
    for _ in range(faults):
        options: list[tuple[int, str]] = []
        free = board.spare_slots - board.lost
        ranks = board.ranks()
        if ranks and free >= 1:
            options += [(w, t) for _, w, t in _RANK]
        if any(n > 0 and len(board.on(n)) <= free for n in board.hosts()):
            options += [(w, t) for _, w, t in _NODE_LOSS]
        options += [(w, t) for _, w, t in _HARMLESS]
        template = rng.choices([t for _, t in options], [w for w, _ in options])[0]
        r = n = 0
        if "{r}" in template:
            r = rng.choice(ranks)
            board.struck.add(r)
            board.lost += 1
        elif template in (t for _, _, t in _NODE_LOSS):
            n = rng.choice([h for h in board.hosts() if h > 0 and len(board.on(h)) <= free])
            board.lost += len(board.on(n))
            board.struck.update(board.on(n))
            board.dead.add(n)
        elif "{n}" in template:
            n = rng.choice(board.hosts())
        clauses.append(template.format(r=r, n=n, s=step, hang=hang))
        step += every
    return clauses


def check_ray_campaign(nodes: int, nproc: int, spare_nodes: int) -> None:
    """Refuse a campaign shape that cannot run on Ray, naming the fix."""
    if nodes < 2:
        raise ConfigurationError(
            "peerckpt chaos --ray needs --nodes ≥ 2: host 0 (Ray's head, the coordinator) is "
            "never killed whole, so another node must hold ranks"
        )
    if spare_nodes < 1:
        raise ConfigurationError(
            "peerckpt chaos --ray needs --spares ≥ 1 spare Ray node: the lost ranks must go "
            "somewhere, or the world shrinks and cannot be compared with the reference"
        )
