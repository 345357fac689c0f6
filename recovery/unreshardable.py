"""The coordinator's side of tracked state that cannot follow a change of world size.

Rank 0 names, at ``ctx.track``, the data loaders and samplers it tracks that have no
``load_resharded_state`` (``runtime/reshardable.py``; its agent relays them as
``Unreshardable`` and replays them to a restarted coordinator). A shrink or a grow would give
every rank another rank's data position, so from then on the world does not change size:

- a job started elastic (``--min-nodes``, or torchrun's ``--nnodes MIN:MAX``) fails at once,
  before its first commit, naming the objects and the fix (``record``);
- ``AllocateNode`` (``peerckpt join``, chaos ``add node``) raises ``NotReshardable``
  (``join_refusal``): the joining side gets the message, the job goes on unharmed;
- a node whose join was accepted before the report arrived is not added when its processes
  connect (``recovery/epochs.py``, ``maybe_grow``): it is refused in ``JobStatus.
  refused_joins``, which ``peerckpt join`` reads and exits on.

Replacing a lost rank with a spare or a restarted process keeps the world's size and is
never refused; so is a node that holds spares only (``AllocateNode(spares_only=True)``:
``--keep-spares`` opening a fresh spare node). Pure functions of the settings: no I/O, no state of their own.
"""

from __future__ import annotations

from peerckpt.errors import NotReshardable
from peerckpt.recovery.job import Settings


def record(settings: Settings, objects: list[str]) -> str | None:
    """Keep rank 0's report in ``settings``; return why the job must fail now (it may
    shrink), or None."""
    known = list(settings.unreshardable)
    settings.unreshardable = tuple(known + [o for o in objects if o not in known])
    if settings.min_nodes is None or not settings.unreshardable:
        return None
    return (
        f"the job may shrink (--min-nodes {settings.min_nodes}), but {_what(settings)}; run it "
        f"without --min-nodes, or {NotReshardable.FIX}"
    )


def join_refusal(settings: Settings) -> str | None:
    """Why no node may join the job, or None."""
    if not settings.unreshardable:
        return None
    return (
        f"job {settings.job} cannot grow: {_what(settings)}; to let nodes join, "
        f"{NotReshardable.FIX}"
    )


def _what(settings: Settings) -> str:
    return (
        "it tracks data-loader state that cannot be resharded: "
        f"{'; '.join(settings.unreshardable)} (after a change of world size every rank would "
        "take another rank's position in a share of another size, losing and repeating samples)"
    )
