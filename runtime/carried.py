"""Values the user's loop carries from one step into the next without tracking them.

A restore re-runs the decorated function: the code before the loop runs again, then the loop
resumes after the committed step. A value made before the loop and made again at the end of
each step for the next one to read — nanoGPT's prefetched batch (``X, Y = get_batch('train')``
before the loop and as the step's last line), a recurrent hidden state carried between
steps — is then the one the code before the loop made, not the one the fault-free run
carried into the step: the run after a restore trains on other data, and nothing says so.

Found at the epoch's first step (``runtime/audit.py`` speaks for it), in the frame that loops
over ``ctx.steps``, from two facts that must both hold:

- the bytecode of the loop's body (from its ``FOR_ITER`` to the instruction after the loop)
  reads the name before it first writes it, and writes it somewhere;
- the name held a tensor (or a tuple, list or dict of them) when the loop started, that is
  no tracked object, and holds another object once the first step is done.

Only tensors count: carried ints and floats (a timer, a running average for the log) do not
change what is trained. Reading the frame costs one ``f_locals`` at the loop's start and one
after its first step, once per process; no local is ever changed, and no value is kept alive
past the first step (``_read``). A loop over
something other than a ``for`` (``next()`` by hand) is not looked at.
"""

from __future__ import annotations

import dis
import inspect
import os
import sys
import types
from typing import Any

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))  # the runtime's frames, skipped
_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_NAME", "LOAD_CLASSDEREF"})
_STORES = frozenset({"STORE_FAST", "STORE_DEREF", "STORE_NAME", "DELETE_FAST", "DELETE_DEREF"})
# Python 3.13's pairs: (first name's access, second name's access)
_PAIRS = {
    "LOAD_FAST_LOAD_FAST": ("load", "load"),
    "STORE_FAST_STORE_FAST": ("store", "store"),
    "STORE_FAST_LOAD_FAST": ("store", "load"),
}
_PEEK = 16  # items of a tuple, list or dict looked at for a tensor


class CarriedWatch:
    """The loop's frame and its candidate values, from the loop's start to its first step's
    end; ``finish`` says which were carried and drops every reference."""

    def __init__(self, frame: types.FrameType, names: dict[str, Any]) -> None:
        self._frame: types.FrameType | None = frame
        self._before = names  # name → its value when the loop started (held: ids are reused)

    @classmethod
    def at_loop_start(
        cls, tracked: dict[str, Any], frame: types.FrameType | None = None
    ) -> CarriedWatch | None:
        """Watch ``frame``, by default the one looping over ``ctx.steps`` (None where there is
        nothing to watch: no ``for`` loop, or no name it reads before writing holds a tensor)."""
        frame = frame or _user_frame()
        if frame is None or not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            return None  # a module's or class's namespace: not a loop's locals
        names = carried_names(frame.f_code, frame.f_lasti)
        if not names:
            return None
        ids = {id(obj) for obj in tracked.values()}
        values = _read(frame, names)
        held = {n: v for n, v in values.items() if id(v) not in ids and _tensors(v)}
        return cls(frame, held) if held else None

    def finish(self) -> list[str]:
        """After the first step: one sentence if some name now holds another object."""
        frame, self._frame = self._frame, None
        before, self._before = self._before, {}
        if frame is None:
            return []
        now = _read(frame, set(before))
        del frame
        changed = [
            n for n, v in before.items() if n in now and now[n] is not v and _tensors(now[n])
        ]
        if not changed:
            return []
        shown = ", ".join(f"`{n}`" for n in changed)
        verb, pronoun = ("holds", "it") if len(changed) == 1 else ("hold", "them")
        return [
            f"{shown} {verb} tensors made before the loop and made again in each step for the "
            "next step to read (a batch fetched ahead, a carried hidden state), not tracked: "
            "after a restore the step reads what the code before the loop made, not what the "
            f"fault-free run carried into it; fetch {pronoun} at the start of the step instead, "
            "or keep the value in an object with state_dict()/load_state_dict() and track that"
        ]


def carried_names(code: types.CodeType, for_iter: int) -> set[str]:
    """Names the body of the ``for`` loop at offset ``for_iter`` reads before it writes them,
    and writes (pure: bytecode only). Empty when ``for_iter`` is not a ``FOR_ITER``."""
    instructions = list(dis.get_instructions(code))
    head = next((i for i in instructions if i.offset == for_iter), None)
    if head is None or head.opname != "FOR_ITER" or not isinstance(head.argval, int):
        return set()
    first: dict[str, str] = {}  # name → its first access in the body: load or store
    stored: set[str] = set()
    for ins in instructions:
        if not head.offset < ins.offset < head.argval:
            continue
        for name, access in _accesses(ins):
            first.setdefault(name, access)
            if access == "store":
                stored.add(name)
    return {n for n, access in first.items() if access == "load" and n in stored}


def _accesses(ins: dis.Instruction) -> list[tuple[str, str]]:
    if ins.opname in _LOADS and isinstance(ins.argval, str):
        return [(ins.argval, "load")]
    if ins.opname in _STORES and isinstance(ins.argval, str):
        return [(ins.argval, "store")]
    pair = _PAIRS.get(ins.opname)
    if pair is not None and isinstance(ins.argval, tuple) and len(ins.argval) == 2:
        return list(zip(ins.argval, pair, strict=True))
    return []


def _read(frame: types.FrameType, names: set[str]) -> dict[str, Any]:
    """The values of ``names`` in ``frame`` (a function's). Before Python 3.13 ``f_locals`` is
    a snapshot of every local that the frame keeps until it is read again: emptied here, or
    it would keep the values of that moment alive for the rest of the loop (a step's logits,
    gigabytes on a GPU). The frame's own locals are untouched: the snapshot is a copy, and
    a tracer refreshes it before it could write it back."""
    values = frame.f_locals
    out = {n: values[n] for n in sorted(names) if n in values}
    if type(values) is dict:  # 3.13's write-through proxy is not a snapshot: left alone
        values.clear()
    return out


def _user_frame() -> types.FrameType | None:
    """The first frame above the runtime's own: the one iterating ``ctx.steps``."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _HERE:
        frame = frame.f_back  # type: ignore[assignment]
    return frame


def _tensors(value: object) -> bool:
    """A tensor (not a parameter), or a tuple, list or dict holding one."""
    if isinstance(value, torch.Tensor):
        return not isinstance(value, torch.nn.Parameter)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return any(
            isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)
            for v in value[:_PEEK]
        )
    return False
