"""The chaos spec: what to break, and when. Pure parsing, no I/O.

Grammar (clauses separated by ``;``)::

    kill rank=R at=S             SIGKILL the process that is rank R, while the job runs step S
    kill node=N at=S             SIGKILL node N's agent and every process on it (its memory is lost)
    kill agent node=N at=S       SIGKILL node N's agent only; its ranks live on, without it
    hang rank=R at=S for=T       SIGSTOP rank R's process, SIGCONT it T seconds later
    partition node=N at=S for=T  cut every connection of node N's agent, both ways, for T seconds
    slow node=N at=S rate=MBPS   throttle node N's data links to MBPS megabytes/s (for=T: then heal)
    kill coordinator at=S        SIGKILL the coordinator; the launcher restarts it
    corrupt rank=R at=S          flip a byte in every replica of rank R's snapshot (on its buddies)
    add node at=S                start a new node (an agent and --nproc-per-node ranks) that joins;
                                 the ranks hold after S until it has (the world grows at S)
    node=@R                      (any node action) the node rank R runs on when the action fires
    … after=T                    (any action but add) T seconds after the step came
    … during=PHASE               (kill actions) strike while a process is inside PHASE:
                                 snapshot (the rank copying its state into its slot),
                                 replication (its agent pushing a snapshot to a buddy) or
                                 recovery (any agent restoring a rank: a second failure while
                                 the first is repaired)

``at=S`` means: while the job's ranks run training step S (the step ``ctx.steps`` yields,
counted from 0, whatever the snapshot interval): the first rank to reach S announces it, the
fault fires, and no rank starts S+1 before it has (``chaos/monkey.py``). ``after=T`` fires T
seconds after the step came, wherever the job is by then (the ranks go on meanwhile);
``during=PHASE`` arms the phase once S came and fires when a process first enters it. Each action
fires once; one that never fired fails the run, and one whose rank, node or step cannot
exist is refused before the job starts (``check_targets``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from peerckpt.errors import ConfigurationError


class ActionKind(str, enum.Enum):
    """What a chaos action does (its value is how the report's JSON names it)."""

    KILL_RANK = "kill_rank"
    KILL_NODE = "kill_node"
    KILL_AGENT = "kill_agent"
    KILL_COORDINATOR = "kill_coordinator"
    HANG_RANK = "hang_rank"
    PARTITION_NODE = "partition_node"
    SLOW_NODE = "slow_node"
    CORRUPT_RANK = "corrupt_rank"
    ADD_NODE = "add_node"

    @property
    def on_a_rank(self) -> bool:
        """Its target is a rank (else a node, or none)."""
        return _FIELDS[self][0] == "rank"

    @property
    def on_a_node(self) -> bool:
        return _FIELDS[self][0] == "node"

    @property
    def needs_network_hooks(self) -> bool:
        """Carried out inside the node agent's links (``chaos/points.py``, ``NetFaults``)."""
        return self in (ActionKind.PARTITION_NODE, ActionKind.SLOW_NODE)


PHASES = ("snapshot", "replication", "recovery")

_USAGE = {
    ActionKind.KILL_RANK: "kill rank=R at=S [after=T] [during=PHASE]",
    ActionKind.KILL_NODE: "kill node=N at=S [after=T] [during=PHASE]",
    ActionKind.KILL_AGENT: "kill agent node=N at=S [after=T] [during=PHASE]",
    ActionKind.KILL_COORDINATOR: "kill coordinator at=S [after=T]",
    ActionKind.HANG_RANK: "hang rank=R at=S for=T [after=T]",
    ActionKind.PARTITION_NODE: "partition node=N at=S for=T [after=T]",
    ActionKind.SLOW_NODE: "slow node=N at=S rate=MBPS [for=T] [after=T]",
    ActionKind.CORRUPT_RANK: "corrupt rank=R at=S [after=T]",
    ActionKind.ADD_NODE: "add node at=S",
}
# kind → (the target field, the fields it requires, the optional ones)
_FIELDS: dict[ActionKind, tuple[str | None, set[str], set[str]]] = {
    ActionKind.KILL_RANK: ("rank", {"at"}, {"after", "during"}),
    ActionKind.KILL_NODE: ("node", {"at"}, {"after", "during"}),
    ActionKind.KILL_AGENT: ("node", {"at"}, {"after", "during"}),
    ActionKind.KILL_COORDINATOR: (None, {"at"}, {"after"}),
    ActionKind.HANG_RANK: ("rank", {"at", "for"}, {"after"}),
    ActionKind.PARTITION_NODE: ("node", {"at", "for"}, {"after"}),
    ActionKind.SLOW_NODE: ("node", {"at", "rate"}, {"for", "after"}),
    ActionKind.CORRUPT_RANK: ("rank", {"at"}, {"after"}),
    ActionKind.ADD_NODE: (None, {"at"}, set()),
}
_SECONDS = {"after", "for", "rate"}  # fields that take a number, not an integer


@dataclass(frozen=True)
class ChaosAction:
    """One fault to inject."""

    kind: ActionKind
    target: int  # the rank or node; -1 for "add node"
    at: int
    text: str
    after: float = 0.0  # seconds to wait once the action is due
    during: str | None = None  # strike inside this phase (one of PHASES)
    duration: float = 0.0  # for=: how long a hang, partition or slow-down lasts (0: forever)
    rate: float = 0.0  # rate=: MB/s for "slow"
    of_rank: int | None = None  # node=@R: the target is the node rank R runs on at the time


@dataclass(frozen=True)
class FiredAction:
    """What firing one action did (``chaos/monkey.py``): the job as the monkey saw it then, the
    process or node it struck, and when; ``fired_at`` None and ``skipped`` saying why where it
    could not fire. A report's ``chaos`` entries are these, as ``to_json`` writes them: the
    optional fields appear only where the action has them (``node`` and ``pid`` on a rank,
    ``node`` on a node, ``segments`` for a corruption, ``during`` and ``struck`` for a phase)."""

    action: str  # the clause as given (``ChaosAction.text``)
    kind: ActionKind
    target: int  # the rank or node; -1 for "add node"
    step: int  # the step the job had reached
    committed_step: int | None
    epoch: int
    fired_at: float | None  # time.time() when it fired; None: skipped
    node: int | None = None  # the node struck (a rank's, a node action's, the one added)
    pid: int | None = None  # the process struck (a rank action)
    skipped: str | None = None  # why it did not fire
    segments: tuple[str, ...] | None = None  # the replicas corrupted
    during: str | None = None  # the phase it struck in (``during=PHASE``)
    struck: dict[str, Any] = field(default_factory=dict)  # where the struck process was

    def to_json(self) -> dict[str, Any]:
        """The report's map: the kind as its string, the optional fields only where set."""
        out: dict[str, Any] = {
            "action": self.action,
            "kind": self.kind.value,
            "target": self.target,
            "step": self.step,
            "committed_step": self.committed_step,
            "epoch": self.epoch,
        }
        if self.node is not None:
            out["node"] = self.node
        if self.pid is not None:
            out["pid"] = self.pid
        out["fired_at"] = self.fired_at
        if self.skipped is not None:
            out["skipped"] = self.skipped
        if self.segments is not None:
            out["segments"] = list(self.segments)
        if self.during is not None:
            out["during"] = self.during
            out["struck"] = dict(self.struck)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FiredAction:
        """A record read back from ``to_json``'s map (a Ray host's result, a report file)."""
        segments = data.get("segments")
        return cls(
            action=data["action"],
            kind=ActionKind(data["kind"]),
            target=data["target"],
            step=data["step"],
            committed_step=data["committed_step"],
            epoch=data["epoch"],
            fired_at=data["fired_at"],
            node=data.get("node"),
            pid=data.get("pid"),
            skipped=data.get("skipped"),
            segments=tuple(segments) if segments is not None else None,
            during=data.get("during"),
            struck=dict(data.get("struck") or {}),
        )


def grammar() -> str:
    return "; ".join(f"'{usage}'" for usage in _USAGE.values())


_TWO_WORDS = {
    ("kill", "agent"): ActionKind.KILL_AGENT,
    ("kill", "coordinator"): ActionKind.KILL_COORDINATOR,
    ("add", "node"): ActionKind.ADD_NODE,
}
_VERBS = {
    "hang": ActionKind.HANG_RANK,
    "partition": ActionKind.PARTITION_NODE,
    "slow": ActionKind.SLOW_NODE,
    "corrupt": ActionKind.CORRUPT_RANK,
}


def _kind_of(words: list[str]) -> tuple[ActionKind | None, list[str]]:
    """The action's kind and its field words, from the clause's leading words."""
    two = _TWO_WORDS.get((words[0], words[1])) if len(words) >= 2 else None
    if two is not None:
        return two, words[2:]
    verb, fields = (words[0], words[1:]) if words else ("", [])
    if verb == "kill":
        has = {w.partition("=")[0] for w in fields}
        node = "node" in has and "rank" not in has
        return (ActionKind.KILL_NODE if node else ActionKind.KILL_RANK), fields
    return _VERBS.get(verb), fields


def parse_chaos(spec: str) -> list[ChaosAction]:
    """Parse a chaos spec; raise ConfigurationError naming the clause that is wrong."""
    actions = []
    for clause in (c.strip() for c in spec.split(";")):
        if clause:
            actions.append(_parse_clause(clause))
    return actions


def _parse_clause(clause: str) -> ChaosAction:
    kind, words = _kind_of(clause.split())
    if kind is None:
        raise ConfigurationError(f"chaos clause {clause!r}: unknown action; use {grammar()}")
    named = {w.partition("=")[0] for w in words}
    if kind in (ActionKind.KILL_RANK, ActionKind.KILL_NODE) and (
        {"rank", "node"} <= named or "at" not in named
    ):
        raise ConfigurationError(
            f"chaos clause {clause!r}: name exactly one of rank= or node=, and at=; use {grammar()}"
        )
    usage = _USAGE[kind]
    target_field, required, optional = _FIELDS[kind]
    allowed = required | optional | ({target_field} if target_field else set())
    fields: dict[str, float] = {}
    during: str | None = None
    of_rank: int | None = None
    for word in words:
        key, sep, value = word.partition("=")
        if key == "node" and target_field == "node" and value.startswith("@"):
            value = value[1:]
            if not value.isdigit():
                raise ConfigurationError(f"chaos clause {clause!r}: node=@R needs a rank number")
            of_rank = int(value)
        if not sep or key in fields or (key == "during" and during is not None):
            raise ConfigurationError(f"chaos clause {clause!r}: bad field {word!r}; use '{usage}'")
        if key not in allowed:
            raise ConfigurationError(
                f"chaos clause {clause!r}: {key}= does not apply here; use '{usage}'"
            )
        if key == "during":
            if value not in PHASES:
                raise ConfigurationError(
                    f"chaos clause {clause!r}: during must be one of {', '.join(PHASES)}"
                )
            during = value
            continue
        try:
            fields[key] = float(value) if key in _SECONDS else int(value)
        except ValueError:
            kind_of = {"after": "a number of seconds", "for": "a number of seconds"}.get(
                key, "a number" if key in _SECONDS else "an integer"
            )
            raise ConfigurationError(
                f"chaos clause {clause!r}: {key} must be {kind_of}, not {value!r}"
            ) from None
        if fields[key] < 0 or (key == "rate" and fields[key] == 0):
            raise ConfigurationError(
                f"chaos clause {clause!r}: {key} must be {'> 0' if key == 'rate' else '≥ 0'}"
            )
    needed = required | ({target_field} if target_field else set())
    missing = [f for f in sorted(needed) if f not in fields]
    if missing:
        raise ConfigurationError(
            f"chaos clause {clause!r}: {', '.join(m + '=' for m in missing)} missing; use '{usage}'"
        )
    return ChaosAction(
        kind,
        int(fields[target_field]) if target_field else -1,
        int(fields["at"]),
        clause,
        after=fields.get("after", 0.0),
        during=during,
        duration=fields.get("for", 0.0),
        rate=fields.get("rate", 0.0),
        of_rank=of_rank,
    )


def check_targets(
    actions: list[ChaosAction], nodes: int, nproc_per_node: int, spare_nodes: int
) -> None:
    """Refuse, before anything starts, an action whose rank or node cannot exist in a job of
    ``nodes`` nodes × ``nproc_per_node`` ranks with ``spare_nodes`` spare nodes (an ``add
    node`` before the action's step adds a node and its ranks); the message names the fix."""
    added = 0
    for action in sorted(actions, key=lambda a: a.at):
        if action.kind is ActionKind.ADD_NODE:
            added += 1
            continue
        world = (nodes + added) * nproc_per_node
        rank = action.of_rank if action.of_rank is not None else None
        if action.kind.on_a_rank:
            rank = action.target
        shape = f"{nodes} node(s) × {nproc_per_node} rank(s)"
        if added:
            shape += f", {added} node(s) added by then"
        if rank is not None and rank >= world:
            raise ConfigurationError(
                f"chaos clause {action.text!r}: rank {rank} does not exist; the job has ranks "
                f"0…{world - 1} ({shape}): name one of those"
            )
        count = nodes + spare_nodes + added
        if action.of_rank is None and action.kind.on_a_node and action.target >= count:
            spare = f", node {nodes} its spare node" if spare_nodes else ""
            raise ConfigurationError(
                f"chaos clause {action.text!r}: node {action.target} does not exist; the job "
                f"has nodes 0…{count - 1} ({shape}{spare}): name one of those"
            )
