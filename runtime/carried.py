"""Tensors and numbers the user's loop carries from one step into the next in its own
variables: saved with each snapshot, and put back when a restored loop resumes.

A restore re-runs the decorated function: the code before the loop runs again, then the loop
resumes after the committed step. A value made before the loop and made again in each step
for the next one to read — nanoGPT's prefetched batch (``X, Y = get_batch('train')`` before
the loop and in the step, "while the model is doing the forward pass"), the hidden state a
truncated-BPTT loop carries between steps — would then be the one the code before the loop
made, not the one the fault-free run carried into the step, and the run after a restore
would train on other data. So the runtime saves them: at each snapshot it reads, in the
frame that loops over ``ctx.steps``, the names the loop's body reads before it writes them
(and writes: ``carried_names``, a liveness pass over the bytecode, so a name one branch
makes afresh and the others carry counts) that hold tensors, or tuples, lists or dicts of
them, or numbers, and are not tracked state; they travel in the snapshot as the rank's private
state, and when a restored loop starts (its RNG states set back as of the committed step)
they are written back into the frame, each tensor on the device of the value the code before
the loop just made. The next step then reads what the fault-free run's did. Numbers the loop
carries are saved and put back the same way: word_language_model's learning rate, divided by 4
on a plateau in a local float, and its best validation loss change what is trained (a timer
comes back as the committed step left it: one log line's time after a restore is off).

The module's variables the loop's body writes (declared ``global`` in the loop's function:
ImageNet's ``best_acc1``, an older script's ``global_step`` counter driving a warm-up) are
carried the same way when the body reads them before writing them, and put back into the
module: a survivor's would otherwise keep the value its last steps left, a replacement's the
one its script's top level made (both seen: MISMATCH, nothing said). Those that another
function of the script writes are not carried: which of them the loop changes is only known
once it has, and one that a setup function writes (a local rank) must not travel to another
process; a number among them that changes during the loop is named once (``drifted``).

A number in the attributes of the script's own objects that the loop uses, two levels down (a
class-based trainer's ``self.global_step`` driving a warm-up, ``args.lr`` halved on a plateau;
not a tracked object's, not torch's), travels with each snapshot beside the value the code
before the loop made; a restore puts it back where the two differ, that is where the loop
changed it. One the loop never changed (``self.local_rank``, set before the loop) is left as
the restoring process made it, since it may belong to that process.

A random generator of the script's own that the loop draws from and does not make (a
``torch.Generator`` seeded before the loop for a diffusion objective's noise, ``random.Random``,
NumPy's ``Generator`` or ``RandomState``, in a local or a module variable) changes in every step
without the loop writing its name: its state is saved with each snapshot and set into the
generator the code before the loop made again (before, a replacement drew the first steps'
noise again and a survivor drew on: MISMATCH, nothing said). So is one an object such a name
holds keeps in its attributes, two levels down (a trainer's ``self.rng``, the
``DataLoader(generator=g)`` of ``self.loader``), unless it lies inside a tracked object, whose
own state holds it (a tracked loader's sampler's).

An iterator of a tracked StatefulDataLoader that the loop carries (the distributed tutorial's
epochs ported onto ``ctx.steps``: ``if step % per_epoch == 0: batches = iter(train_set)``, then
``next(batches)``) cannot travel, but need not: the loader's position does. Its snapshot
records whose iterator the name held, and a restored loop gets ``iter(loader)`` of the restored
loader there (which resumes after the committed step's batch), unless the code before the loop
already made one. Any other value the loop carries that the code before the loop does not make
(a generator, an object) is named at the first snapshot: after a restore the first step would
find the name unbound.

Writing a function's locals from outside is what debuggers do: Python 3.13's ``f_locals`` is
a write-through proxy; before it, the frame's snapshot dict is written and copied back with
``PyFrame_LocalsToFast``. After a topology change nothing is put back: a rank's batch belongs
to the old layout. A loop that is not a ``for`` over ``ctx.steps`` (``next()`` by hand) is
not looked at.
"""

from __future__ import annotations

import argparse
import ctypes
import dis
import gc
import inspect
import json
import logging
import os
import random
import sys
import types
from typing import Any

import torch
from torch.utils.data.dataloader import (
    _MultiProcessingDataLoaderIter,
    _SingleProcessDataLoaderIter,
)

_HERE = os.path.dirname(os.path.abspath(__file__))  # the runtime's frames, skipped
_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_NAME", "LOAD_CLASSDEREF"})
_STORES = frozenset({"STORE_FAST", "STORE_DEREF", "STORE_NAME", "DELETE_FAST", "DELETE_DEREF"})
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL"})  # a module's variable, declared ``global`` to write it
_GLOBAL_STORES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL"})
# Python 3.13's pairs: (first name's access, second name's access)
_PAIRS = {
    "LOAD_FAST_LOAD_FAST": ("load", "load"),
    "STORE_FAST_STORE_FAST": ("store", "store"),
    "STORE_FAST_LOAD_FAST": ("store", "load"),
}
_PEEK = 16  # items of a tuple, list or dict looked at for a tensor
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)  # may go to their argval
_GOTOS = frozenset(  # always go to their argval
    {"JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP", "JUMP_NO_INTERRUPT"}
)
_ENDS = frozenset({"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE"})  # go nowhere
CARRIED = "__carried__"  # the snapshot's name for them (never a ctx.track name: it is refused)
ITERATOR_OF = "__iterator_of__"  # a carried value: {ITERATOR_OF: the tracked loader's name}
log = logging.getLogger("peerckpt.rank")
_PLAIN_ITERATORS = (_SingleProcessDataLoaderIter, _MultiProcessingDataLoaderIter)
_DRIFT_NAMED: set[str] = set()  # module variables ``drifted`` has named in this process


class Carry:
    """The loop over ``ctx.steps`` and the names its body carries from step to step."""

    def __init__(
        self,
        frame: types.FrameType,
        names: set[str],
        module_names: set[str] | None = None,
        read_locals: set[str] | None = None,
        read_module: set[str] | None = None,
    ) -> None:
        self._frame: types.FrameType | None = frame
        self.names = names
        # the module's variables the loop itself writes (``global best_acc1``) and reads
        # before it writes them: carried like its locals
        self.module_names = module_names or set()
        # carried names the code before the loop left unbound (a restore leaves them so)
        self.unbound = names - set(_read(frame, names)) if names else set()
        # random generators of the script's own that the loop draws from, made before the
        # loop: held by a name the loop reads (``generator``) or by an attribute of the
        # object such a name holds (``self.rng``, ``loader.generator``); their states are
        # carried (``name`` or ``name.attribute`` → whether the name is the module's)
        self.generators: dict[str, bool] = {}
        # numbers in the attributes of the script's own objects that the loop uses (a
        # trainer's ``self.global_step``, ``args.lr``), two levels down: carried where the
        # loop changed them (path → (the object, the attribute, the value the code before
        # the loop made))
        self._attributes: dict[str, tuple[object, str, Any]] = {}
        own = self._own = _OwnTypes(frame)
        self._read_module = read_module or set()
        for module, names in ((False, read_locals or set()), (True, read_module or set())):
            values = _read_module(frame, names) if module else _read(frame, names)
            for n, v in values.items():
                self.generators.update({path: module for path in _generators_in(n, v)})
                for path, owner, attribute, number in _numbers_in(n, v, own):
                    self._attributes[path] = (owner, attribute, number)
        # the module's numbers that its other functions write (``global``): named if the
        # loop changes them, since they are not carried (``drifted``)
        written = _written_by_functions(frame.f_globals, frame.f_code.co_filename)
        self._watched = {
            n: v for n, v in _read_module(frame, written - self.module_names).items() if _number(v)
        }

    @property
    def carries(self) -> bool:
        """Whether the loop carries anything from one step into the next."""
        return bool(self.names or self.module_names or self.generators or self._attributes)

    @classmethod
    def at_loop_start(
        cls, frame: types.FrameType | None = None, made_in: types.FrameType | None = None
    ) -> Carry | None:
        """The frame looping over ``ctx.steps``, as its first ``next()`` runs: ``made_in``
        (the frame that called ``ctx.steps``) when it is at a ``for`` loop's head now, as it
        is also while a wrapper such as ``tqdm`` iterates the steps for it (before, the
        wrapper's own frame was taken, and the loop's carried values were never saved); else
        the first frame above the runtime's. None if it is no function's."""
        if frame is None and made_in is not None and _at_for_iter(made_in):
            frame = made_in
        frame = frame or _user_frame()
        if frame is None or not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            return None  # a module's or class's namespace: not a loop's locals
        head = _loop_head(frame)
        body = _body(frame.f_code, head)  # disassembled once for the four passes
        return cls(
            frame,
            _live_names(body, head),
            _live_names(body, head, module=True),
            _read_only(body),
            _read_only(body, module=True),
        )

    def loader_iterators(self) -> list[tuple[str, Any]]:
        """(path, iterator) for each iterator of a plain torch DataLoader (not torchdata's
        StatefulDataLoader, which keeps its position) that the loop's variables hold: as
        their value, inside a generator they hold (``cycle(loader)``, lucidrains' trainers),
        or in an attribute of the script's own objects two levels down (``self.train_iter``,
        ``self.dl = cycle(dl)``). Each iterator once, under the first path found. It walks the
        script's objects, whose attributes or generators may raise when read: then the
        training goes on without the finding."""
        if self._frame is None:
            return []
        found = _read(self._frame, set(self._frame.f_code.co_varnames))
        found.update(_read_module(self._frame, self._read_module))
        out: list[tuple[str, Any]] = []
        seen: set[int] = set()
        try:
            for n, v in found.items():
                for path, iterator in _iterators_in(n, v, self._own):
                    if id(iterator) not in seen:
                        seen.add(id(iterator))
                        out.append((path, iterator))
        except Exception as exc:
            log.debug("looking for the loop's DataLoader iterators failed: %r", exc)
            return []
        return out

    def values(self, covered: set[int], tracked: dict[str, Any]) -> dict[str, Any]:
        """The carried names that hold numbers or tensors now, less those whose tensors
        are tracked state (storage addresses in ``covered``), and those that hold the
        iterator of a loader in ``tracked`` (as ``{ITERATOR_OF: its name}``). Called between
        two steps."""
        if self._frame is None:
            return {}
        found = _read(self._frame, self.names)
        found.update(_read_module(self._frame, self.module_names))  # never a local's name too
        saved = {n: _saved_as(v, covered, tracked) for n, v in found.items()}
        saved.update({n: _generator_state(v) for n, v in self._generators(tracked).items()})
        inside = {id(obj) for obj in tracked.values()}
        for path, (owner, attribute, made) in self._attributes.items():
            now = getattr(owner, attribute, made)
            if now != made and id(owner) not in inside and _number(now):  # the loop changed it
                saved[path] = {ATTRIBUTE: [made, now]}
        return {n: v for n, v in saved.items() if v is not None}

    def _generators(self, tracked: dict[str, Any]) -> dict[str, Any]:
        """The generators the loop draws from, as its names hold them now, less those inside
        a tracked object (a tracked loader's sampler's: its own state holds it)."""
        assert self._frame is not None
        bases = {key.partition(".")[0]: module for key, module in self.generators.items()}
        values = _read(self._frame, {n for n, module in bases.items() if not module})
        values.update(_read_module(self._frame, {n for n, module in bases.items() if module}))
        inside = {id(obj) for obj in tracked.values()}
        found = {}
        for key in self.generators:
            name, *attributes = key.split(".")
            value = values.get(name)
            path = [value]
            for attribute in attributes:
                value = getattr(value, attribute, None)
                path.append(value)
            if _kind(value) is not None and not any(id(v) in inside for v in path):
                found[key] = value
        return found

    def drifted(self) -> list[str]:
        """What a snapshot's audit says, once each, of the module's numbers that changed since
        the loop began and are written by the script's other functions, not by the loop: they
        are not carried, so after a restore they keep the value the process has."""
        if self._frame is None or not self._watched:
            return []
        now = _read_module(self._frame, set(self._watched))
        was = {n: self._watched.pop(n) for n in sorted(now) if now[n] != self._watched[n]}
        moved = [n for n in was if n not in _DRIFT_NAMED]  # once per process
        _DRIFT_NAMED.update(moved)
        return [
            f"the module variable `{n}` changed during the loop ({_short(was[n])} → "
            f"{_short(now[n])}), written by a function the loop calls: peerckpt carries the "
            "module variables the loop's own body writes, not those of the functions it calls; "
            f"after a restore `{n}` keeps this process's value (a replacement's is the one its "
            "script's top level made). Assign it in the loop's body, or keep it in a tracked "
            "object's state_dict()"
            for n in moved
        ]

    def unsaved(self, tracked: dict[str, Any]) -> list[str]:
        """What the first snapshot's audit says of carried names that the code before the
        loop leaves unbound and whose value now travels in no snapshot."""
        if self._frame is None or not self.unbound:
            return []
        found = _read(self._frame, self.unbound)
        return [
            f"the loop carries `{n}` (a {type(v).__name__}) from one step into the next, and the "
            f"code before the loop does not make it: after a restore the first step finds `{n}` "
            "unbound (UnboundLocalError). Tensors, numbers and iterators of a tracked "
            "StatefulDataLoader are carried across a restore; make anything else before the loop"
            for n, v in sorted(found.items())
            if _saved_as(v, set(), tracked) is None and not isinstance(v, _PLAIN_ITERATORS)
        ]

    def put_back(self, saved: dict[str, Any], tracked: dict[str, Any]) -> list[str]:
        """Write ``saved`` into the loop's frame, each tensor moved to the device of the one
        the name holds now, and a new iterator of the (restored) tracked loader for an
        iterator of it; return the names written."""
        if self._frame is None:
            return []
        states = {n: v for n, v in saved.items() if n in self.generators and _is_state(v)}
        put = []
        for n, generator in self._generators(tracked).items():  # the code before made them
            if n in states and _set_generator_state(generator, states[n]):
                put.append(n)
        for path, value in saved.items():
            if not (isinstance(value, dict) and set(value) == {ATTRIBUTE}):
                continue
            made, now = value[ATTRIBUTE]
            found = self._attributes.get(path)
            # Only what the loop changed: what the code before it made (a rank, a device
            # index) stays this process's own
            if found is not None and made != now:
                setattr(found[0], found[1], now)
                put.append(path)
        wanted = {n: v for n, v in saved.items() if n in self.names or n in self.module_names}
        if not wanted:
            return sorted(put)
        now = _read(self._frame, set(wanted) & self.names)
        now.update(_read_module(self._frame, set(wanted) & self.module_names))
        values: dict[str, Any] = {}
        for n, v in wanted.items():
            if isinstance(v, dict) and set(v) == {ITERATOR_OF}:
                loader = tracked.get(v[ITERATOR_OF])
                current = getattr(loader, "_iterator", None)
                if loader is None or (current is not None and now.get(n) is current):
                    continue  # gone, or the code before the loop made it: its place is right
                # The restored loader resumes its epoch's order from its own state, but
                # iter() draws a seed for a shuffling sampler from torch's generator, which
                # the fault-free run did not do here: that draw must not move it.
                with torch.random.fork_rng(devices=[]):
                    values[n] = iter(loader)
            else:
                values[n] = _placed_like(v, now.get(n))
        local = {n: v for n, v in values.items() if n in self.names}
        if local:
            _write(self._frame, local)
        for n, v in values.items():
            if n in self.module_names:
                self._frame.f_globals[n] = v
        return sorted([*values, *put])

    def close(self) -> None:
        self._frame = None
        self._attributes.clear()  # it holds the script's objects


def _placed_like(saved: Any, now: Any) -> Any:
    if isinstance(saved, torch.Tensor):
        if isinstance(now, torch.Tensor) and now.device != saved.device:
            return saved.to(now.device)
        return saved
    if isinstance(saved, dict):
        return {
            k: _placed_like(v, now.get(k) if isinstance(now, dict) else None)
            for k, v in saved.items()
        }
    if isinstance(saved, (list, tuple)):
        same = isinstance(now, (list, tuple)) and len(now) == len(saved)
        items = [_placed_like(v, now[i] if same else None) for i, v in enumerate(saved)]
        return type(saved)(items)
    return saved


def _saved_as(value: Any, covered: set[int], tracked: dict[str, Any]) -> Any:
    """What a snapshot saves for a carried ``value``: the value itself (a number, or tensors
    that are not tracked state: storage addresses in ``covered``), ``{ITERATOR_OF: name}`` for
    the iterator of a loader in ``tracked``; None for anything else."""
    if isinstance(value, (int, float)) or (_tensors(value) and not _aliases(value, covered)):
        return value
    loader = _iterated(value, tracked)
    return {ITERATOR_OF: loader} if loader is not None else None


def _iterated(value: Any, tracked: dict[str, Any]) -> str | None:
    """The name of the tracked loader (one that keeps its place: torchdata's
    StatefulDataLoader) whose live iterator ``value`` is."""
    if value is None:
        return None
    for name, obj in tracked.items():
        if hasattr(obj, "state_dict") and getattr(obj, "_iterator", None) is value:
            return name
    return None


def _aliases(value: Any, covered: set[int]) -> bool:
    """Does a tensor of ``value`` share memory with tracked state?"""
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().data_ptr() in covered
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return any(_aliases(v, covered) for v in value[:_PEEK])
    return False


def _write(frame: types.FrameType, values: dict[str, Any]) -> None:
    """Bind ``values`` in ``frame`` (a function's, suspended in a call)."""
    if sys.version_info >= (3, 13):
        proxy = frame.f_locals  # write-through (PEP 667)
        for name, value in values.items():
            proxy[name] = value
        return
    snapshot = frame.f_locals  # every local, fresh
    snapshot.update(values)
    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
    snapshot.clear()  # as ``_read``: keep no value of the loop alive


def carried_names(code: types.CodeType, for_iter: int, module: bool = False) -> set[str]:
    """Names the body of the ``for`` loop at offset ``for_iter`` writes, and may read before
    it writes them on some path through it (live where the body begins: a hidden state that
    one branch makes afresh and the others carry counts), from the bytecode alone. Empty when
    ``for_iter`` is not a ``FOR_ITER``. Exception handlers are not followed. ``module``: the
    module's variables the body writes (declared ``global``) instead of its locals."""
    return _live_names(_body(code, for_iter), for_iter, module)


def _live_names(body: list[dis.Instruction], for_iter: int, module: bool = False) -> set[str]:
    """``carried_names`` of the loop ``body`` (``_body``) whose ``FOR_ITER`` is at
    ``for_iter``."""
    if not body:
        return set()
    at = {ins.offset: k for k, ins in enumerate(body)}
    entry = 0  # the next iteration begins where the body does (the back edge's FOR_ITER)

    def index(offset: object) -> int | None:
        if offset == for_iter:
            return entry
        return at.get(offset) if isinstance(offset, int) else None

    successors: list[list[int]] = []
    for k, ins in enumerate(body):
        after = [k + 1] if k + 1 < len(body) else []
        if ins.opname in _ENDS:
            nexts: list[int | None] = []
        elif ins.opname in _GOTOS:
            nexts = [index(ins.argval)]
        elif ins.opcode in _JUMPS:
            nexts = [index(ins.argval), *after]
        else:
            nexts = list(after)
        successors.append([n for n in nexts if n is not None])
    live: list[set[str]] = [set() for _ in body]
    changed = True
    while changed:  # backward liveness to a fixed point (each pass only adds names)
        changed = False
        for k in reversed(range(len(body))):
            names = set().union(*(live[n] for n in successors[k]))
            for name, access in reversed(_accesses(body[k], module)):
                if access == "store":
                    names.discard(name)
                else:
                    names.add(name)
            if names != live[k]:
                live[k], changed = names, True
    stored = {n for ins in body for n, access in _accesses(ins, module) if access == "store"}
    return live[entry] & stored


def _read_only(body: list[dis.Instruction], module: bool = False) -> set[str]:
    """Names the loop ``body`` reads and never writes (what it uses from the code before it:
    a generator it draws from); ``module``: the module's variables instead of its locals."""
    accesses = [a for ins in body for a in _accesses(ins, module)]
    return {n for n, a in accesses if a == "load"} - {n for n, a in accesses if a == "store"}


def _body(code: types.CodeType, for_iter: int) -> list[dis.Instruction]:
    """The instructions of the ``for`` loop's body whose ``FOR_ITER`` is at ``for_iter`` (none
    where there is no ``FOR_ITER``)."""
    instructions = list(dis.get_instructions(code))
    head = next((i for i in instructions if i.offset == for_iter), None)
    if head is None or head.opname != "FOR_ITER" or not isinstance(head.argval, int):
        return []
    return [i for i in instructions if head.offset < i.offset < head.argval]


GENERATOR = "__generator__"  # a carried generator's state: {GENERATOR: kind, "state": …}
ATTRIBUTE = "__attribute__"  # a carried attribute: {ATTRIBUTE: [as made before the loop, now]}


def _kind(value: object) -> str | None:
    """What sort of random generator ``value`` is, if it is one whose state can travel."""
    if isinstance(value, torch.Generator):
        return "torch"
    if isinstance(value, random.Random):
        return "random"
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(value, numpy.random.Generator):
            return "numpy"
        if isinstance(value, numpy.random.RandomState):
            return "numpy-legacy"
    return None


def _own_generator(value: object) -> bool:
    """A generator of the script's own: not one of the process-wide ones a snapshot already
    holds (torch's default, ``random``'s, NumPy's legacy one)."""
    if _kind(value) is None:
        return False
    numpy = sys.modules.get("numpy")
    shared = [torch.default_generator, getattr(random, "_inst", None)]
    if numpy is not None:
        shared.append(getattr(numpy.random.mtrand, "_rand", None))
    return not any(value is g for g in shared)


def _generators_in(name: str, value: object, depth: int = 2) -> list[str]:
    """Paths (``name``, ``name.attribute``, ``name.attribute.attribute``) to the script's own
    generators in ``value`` and in its attributes, ``depth`` levels down."""
    if _own_generator(value):
        return [name]
    if depth == 0:
        return []
    return [
        path
        for attribute, held in _attributes(value)
        for path in _generators_in(f"{name}.{attribute}", held, depth - 1)
    ]


class _OwnTypes:
    """Whether an object is one of the script's own: of a class its module (or a module beside
    it, not an installed package) defines, or a plain namespace (``argparse.Namespace``,
    ``types.SimpleNamespace``). Torch's objects and the like keep counters of their own
    (DDP's, a scheduler's) that a snapshot holds or that do not matter."""

    def __init__(self, frame: types.FrameType) -> None:
        self.module = frame.f_globals.get("__name__")
        self.folder = os.path.dirname(os.path.abspath(frame.f_code.co_filename))

    def __call__(self, value: object) -> bool:
        kind = type(value)
        if kind in (argparse.Namespace, types.SimpleNamespace):
            return True
        name = getattr(kind, "__module__", None)
        if name in (self.module, "__main__"):
            return True
        module = sys.modules.get(name or "")
        path = os.path.abspath(getattr(module, "__file__", None) or "/")
        return os.path.dirname(path) == self.folder and "site-packages" not in path


def _numbers_in(
    name: str, value: object, own: _OwnTypes, depth: int = 2
) -> list[tuple[str, object, str, Any]]:
    """(path, object, attribute, number) for the numbers in the attributes of ``value`` and
    of the script's own objects in them, ``depth`` levels down, where ``value`` is one."""
    if depth == 0 or not own(value):
        return []
    found: list[tuple[str, object, str, Any]] = []
    for attribute, held in _attributes(value):
        if _number(held):
            found.append((f"{name}.{attribute}", value, attribute, held))
        else:
            found += _numbers_in(f"{name}.{attribute}", held, own, depth - 1)
    return found


def _iterators_in(
    name: str, value: object, own: _OwnTypes, depth: int = 2
) -> list[tuple[str, Any]]:
    """(path, iterator) for the plain DataLoader iterators in ``value``: itself, those a
    generator it is runs over (on its frame's stack, so found among the generator's
    referents), and those in the attributes of the script's own objects, ``depth`` levels
    down."""
    if isinstance(value, _PLAIN_ITERATORS):
        return [(name, value)]
    if depth == 0:
        return []
    if isinstance(value, types.GeneratorType):
        held = gc.get_referents(value)
        return [found for h in held for found in _iterators_in(name, h, own, depth - 1)]
    if not own(value):
        return []
    return [
        found
        for attribute, held in _attributes(value)
        for found in _iterators_in(f"{name}.{attribute}", held, own, depth - 1)
    ]


def _attributes(value: object) -> list[tuple[str, Any]]:
    """The attributes an object keeps in its ``__dict__`` (not a module's, a class's or a
    function's)."""
    if isinstance(value, (types.ModuleType, type, types.FunctionType, types.MethodType)):
        return []
    attributes = getattr(value, "__dict__", None)
    return list(attributes.items()) if isinstance(attributes, dict) else []


def _generator_state(generator: Any) -> dict[str, Any] | None:
    """A generator's state as a carried value (a tensor, or JSON for the others' integers,
    which may exceed 64 bits)."""
    kind = _kind(generator)
    if kind == "torch":
        return {GENERATOR: kind, "state": generator.get_state()}
    if kind == "random":
        return {GENERATOR: kind, "state": json.dumps(generator.getstate())}
    if kind == "numpy":
        return {GENERATOR: kind, "state": json.dumps(generator.bit_generator.state)}
    if kind == "numpy-legacy":
        name, keys, pos, has_gauss, cached = generator.get_state(legacy=True)
        state = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
        return {GENERATOR: kind, "state": json.dumps(state)}
    return None


def _is_state(value: object) -> bool:
    return isinstance(value, dict) and isinstance(value.get(GENERATOR), str) and "state" in value


def _set_generator_state(generator: Any, saved: dict[str, Any]) -> bool:
    """Set ``generator`` to a state ``_generator_state`` made; False if it is of another kind."""
    kind = _kind(generator)
    if kind != saved[GENERATOR]:
        return False
    state = saved["state"]
    if kind == "torch":
        generator.set_state(state)
    elif kind == "random":
        version, internal, gauss = json.loads(state)
        generator.setstate((version, tuple(internal), gauss))
    elif kind == "numpy":
        generator.bit_generator.state = json.loads(state)
    else:
        numpy = sys.modules["numpy"]
        name, keys, pos, has_gauss, cached = json.loads(state)
        generator.set_state((name, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))
    return True


def _accesses(ins: dis.Instruction, module: bool = False) -> list[tuple[str, str]]:
    loads, stores = (_GLOBAL_LOADS, _GLOBAL_STORES) if module else (_LOADS, _STORES)
    if ins.opname in loads and isinstance(ins.argval, str):
        return [(ins.argval, "load")]
    if ins.opname in stores and isinstance(ins.argval, str):
        return [(ins.argval, "store")]
    if module:
        return []
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


def _read_module(frame: types.FrameType, names: set[str]) -> dict[str, Any]:
    """The values of the module variables ``names`` of ``frame``'s function."""
    values = frame.f_globals
    return {n: values[n] for n in sorted(names) if n in values}


def _written_by_functions(namespace: dict[str, Any], filename: str) -> set[str]:
    """The module variables that the functions (and methods) defined in ``filename`` and
    found in its namespace ``namespace`` write (``global x; x = …``), from their bytecode."""
    found: set[str] = set()
    seen: set[int] = set()
    codes = [
        v.__code__
        for v in list(namespace.values())
        if isinstance(v, types.FunctionType) and v.__code__.co_filename == filename
    ]
    codes += [
        f.__code__
        for v in list(namespace.values())
        if isinstance(v, type)
        for f in vars(v).values()
        if isinstance(f, types.FunctionType) and f.__code__.co_filename == filename
    ]
    while codes:
        code = codes.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        found |= {
            ins.argval
            for ins in dis.get_instructions(code)
            if ins.opname in _GLOBAL_STORES and isinstance(ins.argval, str)
        }
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return found


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


def _instruction_at(frame: types.FrameType, lasti: int | None = None) -> dis.Instruction | None:
    """The instruction ``frame`` is at. ``f_lasti`` may point into the inline cache that
    follows an instruction (Python 3.12 leaves a generator's loop at ``FOR_ITER``'s cache
    entry, two bytes on): the instruction is the last one at or before it."""
    at = frame.f_lasti if lasti is None else lasti
    found = None
    for ins in dis.get_instructions(frame.f_code):
        if ins.offset > at:
            break
        found = ins
    return found


def _loop_head(frame: types.FrameType) -> int:
    """The offset of the instruction ``frame`` is at (``carried_names`` wants a FOR_ITER)."""
    ins = _instruction_at(frame)
    return ins.offset if ins is not None else frame.f_lasti


def _at_for_iter(frame: types.FrameType) -> bool:
    """Whether ``frame`` is at a ``FOR_ITER`` (the head of the loop it runs)."""
    ins = _instruction_at(frame)
    return ins is not None and ins.opname == "FOR_ITER"


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
