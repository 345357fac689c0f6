"""Who is in the job: the nodes' agents and every process they reported. Pure state, no I/O.

The coordinator owns one ``Registry`` and changes it under its lock. An agent registers
with its node index and data address; processes join (ranks, spares, joiners) and are lost
one by one (their agent saw them exit) or with their node. A node's agent also carries the
mailbox of events streamed to it (``Watch``, ``mailboxes.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from peerckpt.membership import Membership
from peerckpt.messages.control import NodeStats
from peerckpt.recovery.mailboxes import EventHub, Mailbox
from peerckpt.states import ROLE, ProcRole


@dataclass
class AgentInfo:
    """A node, as its agent registered it."""

    node: int
    data_addr: str
    spare_node: bool
    joining: int = 0  # ranks this node brings to a running job (``peerckpt join``)
    # Registered to join a running job: its launcher (``peerckpt join``) may not restart its
    # processes in place, so the coordinator never waits for it to (``restartable_nodes``).
    grew: bool = False
    # Its ``Watch`` stream's events; ``Registry.add_agent`` gives it one fed by broadcasts.
    events: Mailbox = field(default_factory=lambda: EventHub().mailbox())
    alive: bool = True
    last_heartbeat: float = field(default_factory=time.monotonic)
    stats: NodeStats | None = None  # its last heartbeat's report, for observers only


@dataclass
class ProcInfo:
    """A process of the job: a rank, a spare, or a joiner waiting for the world to grow."""

    node: int
    pid: int
    role: ProcRole
    rank: int | None
    alive: bool = True

    def promote(self, rank: int) -> None:
        """A spare or joiner becomes ``rank``."""
        self.role = ROLE.check(self.role, ProcRole.RANK)
        self.rank = rank


class Registry:
    """Agents by node, processes by (node, pid)."""

    def __init__(self) -> None:
        self.hub = EventHub()  # what the agents' event streams read
        self.agents: dict[int, AgentInfo] = {}
        self.procs: dict[tuple[int, int], ProcInfo] = {}
        self._reserved: set[int] = set()  # node indexes handed out to joining nodes

    def add_agent(self, agent: AgentInfo) -> AgentInfo:
        """Register ``agent`` (replacing an earlier registration of its node, whose stream
        receives nothing more) with a mailbox that every broadcast from now on reaches."""
        old = self.agents.get(agent.node)
        if old is not None:
            old.events.detach()
        agent.events = self.hub.mailbox()
        self.agents[agent.node] = agent
        return agent

    def allocate_node(self) -> int:
        """A node index no agent has and none was handed out before."""
        node = max([*self.agents, *self._reserved, -1]) + 1
        self._reserved.add(node)
        return node

    def add_proc(self, node: int, pid: int, role: ProcRole, rank: int | None) -> ProcInfo:
        proc = ProcInfo(node, pid, role, rank)
        self.procs[(node, pid)] = proc
        return proc

    def member_rank(self, proc: ProcInfo, membership: Membership | None) -> int | None:
        """The rank ``proc`` plays in ``membership`` (before any: the rank it was started as)."""
        if membership is None:
            return proc.rank if proc.role is ProcRole.RANK else None
        for rank, a in membership.ranks.items():
            if (a.node, a.pid) == (proc.node, proc.pid):
                return rank
        return None

    def lose_node(self, node: int, membership: Membership | None) -> set[int]:
        """Mark node ``node`` and its processes lost; return the ranks that were on it."""
        agent = self.agents[node]
        agent.alive = False
        agent.events.put(None)
        lost = set()
        for proc in self.procs.values():
            if proc.node == node and proc.alive:
                proc.alive = False
                rank = self.member_rank(proc, membership)
                if rank is not None:
                    lost.add(rank)
        return lost

    def joined_spares(self, membership: Membership | None) -> list[ProcInfo]:
        """Spares ready to take a rank: alive, on a live node, not in the membership; those
        on spare nodes first (a spare on a rank node shares its failure domain)."""
        return sorted(
            (
                p
                for p in self.procs.values()
                if p.role is ProcRole.SPARE
                and p.alive
                and self.member_rank(p, membership) is None
                and self.agents[p.node].alive
            ),
            key=lambda p: (not self.agents[p.node].spare_node, p.node, p.pid),
        )

    def joiners(self, node: int) -> list[ProcInfo]:
        """The live joiners of node ``node``, in the order they become ranks."""
        return sorted(
            (
                p
                for p in self.procs.values()
                if p.node == node and p.role is ProcRole.JOINER and p.alive
            ),
            key=lambda p: p.pid,
        )

    def restartable_nodes(self) -> frozenset[int]:
        """Nodes where a lost rank may be restarted in place: agent alive (it holds the
        rank's state), started with the job (its launcher carries the restarts out)."""
        return frozenset(n for n, a in self.agents.items() if a.alive and not a.grew)

    def node_addrs(self) -> dict[int, str]:
        """The live agents' data addresses."""
        return {n: a.data_addr for n, a in self.agents.items() if a.alive}

    def broadcast(self, event: Any) -> None:
        """Send ``event`` to every live agent (a lost one's stream has ended): O(1)."""
        self.hub.broadcast(event)

    def send(self, node: int, event: Any) -> None:
        agent = self.agents.get(node)
        if agent is not None and agent.alive:
            agent.events.put(event)
