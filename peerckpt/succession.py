"""Where a job's coordinator goes when its host is gone: one order every process derives.

A multi-host job (``peerckpt run --nnodes …``) starts its coordinator on the rendezvous host.
If that host dies, the coordinator must move, or the job dies with it. There is no election:
every agent and every host's launcher derives the same list from what it already knows — the
coordinator's endpoint and the live nodes' addresses (an epoch's ``Membership.node_addrs``,
the ``JobStatus.node_addrs`` the launchers poll) — and the coordinator's port, which every
host uses:

    [the current endpoint, node a's host:PORT, node b's host:PORT, …]   a < b < …

skipping the current endpoint's own host (it is the one presumed gone). Agents register with
the first endpoint that answers, trying them in this order; the launcher of the host at
position ``p`` starts a coordinator at its own endpoint once the coordinator has been silent
for ``TAKEOVER_AFTER_S + (p - 1) × TAKEOVER_STEP_S`` and no endpoint before its own answers,
and stops it again (its agents follow) if one before its own answers after all.
A coordinator that only crashed, on a host still alive, is restarted in place by that host's
launcher well within ``TAKEOVER_AFTER_S``; so is a takeover by the host before, if that host
is alive. The new coordinator rebuilds its state from the agents' reports
(``recovery/rebuild.py``) as a restarted one does; the dead host's nodes are then lost nodes.
"""

from __future__ import annotations

from collections.abc import Mapping

# Silence before the first successor takes over: longer than restarting a crashed coordinator
# in place (a process start, ~1-2 s on a loaded machine), and short: the survivors' ranks,
# whose collectives broke with the host, wait ``suspect_s`` (30 s) for the next epoch, which
# the moved coordinator opens once the agents are back (``recovery/rebuild.py``).
TAKEOVER_AFTER_S = 3.0
# More for each successor after the first: the time for one to start answering (6 s measured
# under a load of 10 on 2 cores). Should two start anyway, the agents register with the
# earlier one, and the later one steps down when it finds the earlier one answering.
TAKEOVER_STEP_S = 8.0
STEP_DOWN_WINDOW_S = 60.0  # how long a coordinator that took over looks for an earlier one


def split(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[v6]:PORT``) → (host, port)."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def succession(current: str, node_addrs: Mapping[int, str]) -> list[str]:
    """The coordinator's endpoints in order of succession: ``current`` first, then each
    live node's host (``node_addrs``: node → its agent's data address ``HOST:PORT``) at the
    coordinator's port, by node index, once per host, skipping ``current``'s host."""
    host, port = split(current)
    order, seen = [current], {host}
    for _, addr in sorted(node_addrs.items()):
        node_host = split(addr)[0]
        if node_host not in seen:
            seen.add(node_host)
            order.append(join(node_host, port))
    return order


def takeover_after(position: int) -> float:
    """How long the coordinator must have been silent before the host at ``position`` (≥ 1)
    of the succession starts one."""
    return TAKEOVER_AFTER_S + (position - 1) * TAKEOVER_STEP_S
