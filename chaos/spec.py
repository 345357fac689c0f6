"""The chaos spec: what to break, and when. Pure parsing, no I/O.

Grammar (clauses separated by ``;``)::

    kill rank=R at=S      SIGKILL the process that is rank R, while the job runs step S
    kill node=N at=S      SIGKILL node N's agent and every process on it (its memory is lost)
    add node at=S         start a new node (an agent and --nproc-per-node ranks) that joins
    corrupt rank=R at=S   flip a byte in every replica of rank R's snapshot (on its buddies)
    … after=T             (on kill and corrupt actions) T seconds later, e.g. once a flush ended

"While the job runs step S" means: as soon as step S-1 is committed (``at=0``: as soon as the
first epoch starts). Each action fires once.
"""

from __future__ import annotations

from dataclasses import dataclass

from peerckpt.errors import ConfigurationError

_GRAMMAR = (
    "'kill rank=R at=S', 'kill node=N at=S', 'corrupt rank=R at=S' (each with an optional "
    "'after=SECONDS') or 'add node at=S', separated by ';'"
)


@dataclass(frozen=True)
class ChaosAction:
    """One fault to inject."""

    kind: str  # "kill_rank", "kill_node", "corrupt_rank" or "add_node"
    target: int
    at: int
    text: str
    after: float = 0.0  # seconds to wait once the action is due


def parse_chaos(spec: str) -> list[ChaosAction]:
    """Parse a chaos spec; raise ConfigurationError naming the clause that is wrong."""
    actions = []
    for clause in (c.strip() for c in spec.split(";")):
        if not clause:
            continue
        words = clause.split()
        if words[:2] == ["add", "node"]:
            at = [w for w in words[2:] if w.startswith("at=")]
            if len(words) != 3 or len(at) != 1 or not at[0][3:].isdigit():
                raise ConfigurationError(f"chaos clause {clause!r}: use 'add node at=S'")
            actions.append(ChaosAction("add_node", -1, int(at[0][3:]), clause))
            continue
        if not words or words[0] not in ("kill", "corrupt"):
            raise ConfigurationError(f"chaos clause {clause!r}: unknown action; use {_GRAMMAR}")
        fields: dict[str, float] = {}
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep or key not in ("rank", "node", "at", "after") or key in fields:
                raise ConfigurationError(
                    f"chaos clause {clause!r}: bad field {word!r}; use {_GRAMMAR}"
                )
            try:
                fields[key] = float(value) if key == "after" else int(value)
            except ValueError:
                kind_of = "a number of seconds" if key == "after" else "an integer"
                raise ConfigurationError(
                    f"chaos clause {clause!r}: {key} must be {kind_of}, not {value!r}"
                ) from None
            if fields[key] < 0:
                raise ConfigurationError(f"chaos clause {clause!r}: {key} must be ≥ 0")
        if ("rank" in fields) == ("node" in fields) or "at" not in fields:
            raise ConfigurationError(
                f"chaos clause {clause!r}: name exactly one of rank= or node=, and at=; use {_GRAMMAR}"
            )
        if words[0] == "corrupt" and "rank" not in fields:
            raise ConfigurationError(f"chaos clause {clause!r}: use 'corrupt rank=R at=S'")
        if words[0] == "corrupt":
            kind = "corrupt_rank"
        else:
            kind = "kill_rank" if "rank" in fields else "kill_node"
        target = int(fields["rank"] if "rank" in fields else fields["node"])
        actions.append(
            ChaosAction(kind, target, int(fields["at"]), clause, fields.get("after", 0.0))
        )
    return actions
