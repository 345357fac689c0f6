"""Typed messages: every control message of peerckpt is a frozen dataclass, coded in one place.

Three families share this codec:

- ``messages.control``: agents, launchers and tools ↔ the coordinator (gRPC), and the
  events the coordinator streams to agents;
- ``messages.local``: a rank process ↔ its node agent (Unix socket);
- ``messages.data``: agent ↔ agent data links (TCP; bulk bytes travel raw beside them).

A message class is declared with ``@message("name")``. ``encode`` turns it into a msgpack
map (``{"type": name, field: value, …}``, nested messages as maps); ``decode`` turns a map
back into the class its ``type`` names, after checking every field against the class's type
hints, so a receiver never handles a dict, a missing field or a value of the wrong type:
whatever a peer sends, it gets a typed message or a ``ProtocolError`` naming the field.

Types a field may have: ``int``, ``float``, ``bool``, ``str``, ``bytes``, ``Any`` (opaque,
kept as decoded: chunk layouts the planner reads as tables), ``X | None``, ``list[X]``,
``tuple[X, ...]``, ``dict[K, V]``, another message class, or a class with ``to_msg`` and
``from_msg`` (``ChunkRecord``, ``SnapshotManifest``: their compact list form).

A frame on a socket (``peerckpt/wire.py``) has a small header and an optional payload; a
message class names in ``PAYLOAD`` the one field that may be large (a manifest, a list of
wanted chunks), which then travels msgpack-encoded as the payload (``to_frame``/``from_frame``).

A receiver dispatches through a table, ``Dispatch``: class → handler, never a chain of
``type ==`` tests. This module never touches a socket and never unpickles anything.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from peerckpt.codec import pack, unpack
from peerckpt.errors import PeerckptError, ProtocolError

M = TypeVar("M")
R = TypeVar("R")

# Keys a frame's header carries besides the message's own fields.
ENVELOPE = frozenset({"type", "len", "req"})
_REGISTRY: dict[str, type[Any]] = {}


def message(name: str) -> Callable[[type[M]], type[M]]:
    """Register a frozen dataclass as the message ``name``."""

    def register(cls: type[M]) -> type[M]:
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"message {name!r} must be a frozen dataclass")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise TypeError(f"two message classes are named {name!r}")
        cls.TYPE = name  # type: ignore[attr-defined]
        _REGISTRY[name] = cls
        return cls

    return register


class Message:
    """Base of every message class: ``TYPE`` (set by ``@message``) and ``PAYLOAD``."""

    TYPE: ClassVar[str] = ""
    PAYLOAD: ClassVar[str | None] = None  # the field that travels as a frame's payload


def type_name(cls: type[Any]) -> str:
    name = getattr(cls, "TYPE", "")
    if not name:
        raise TypeError(f"{cls.__name__} is not a registered message")
    return str(name)


# -- encoding -------------------------------------------------------------------------------
def encode(msg: Any) -> dict[str, Any]:
    """The msgpack map of a message: its ``type`` and every field."""
    out: dict[str, Any] = {"type": type_name(type(msg))}
    for f in dataclasses.fields(msg):
        out[f.name] = _to_wire(getattr(msg, f.name))
    return out


def _to_wire(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, Message) or (
        dataclasses.is_dataclass(value) and bool(getattr(type(value), "TYPE", ""))
    ):
        return encode(value)
    if hasattr(value, "to_msg"):
        return value.to_msg()
    if isinstance(value, (list, tuple, frozenset, set)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    if hasattr(value, "value"):  # an enum: its value
        return value.value
    raise TypeError(f"cannot encode {type(value).__name__} in a message")


def to_frame(msg: Any) -> tuple[dict[str, Any], bytes | None]:
    """Header and payload of a message sent as a frame (``PAYLOAD`` goes in the payload)."""
    header = encode(msg)
    field = getattr(type(msg), "PAYLOAD", None)
    if field is None:
        return header, None
    return header, pack(header.pop(field))


# -- decoding -------------------------------------------------------------------------------
def decode(raw: Any, expect: type[M] | None = None, *, where: str = "a peer") -> Any:
    """The message a map describes; ``ProtocolError`` for anything else.

    ``expect``: the class (or base class) the caller can handle; any other message is refused.
    Keys of the frame envelope (``len``, ``req``) are ignored, any other unknown key refused.
    """
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where} sent a {type(raw).__name__} where a message map belongs")
    name = raw.get("type")
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"{where} sent an unknown message type {name!r}")
    if expect is not None and not issubclass(cls, expect):
        raise ProtocolError(
            f"{where} sent {name!r} where {getattr(expect, 'TYPE', '') or expect.__name__} "
            "was expected"
        )
    return _decode_fields(cls, raw, where)


def from_frame(
    header: dict[str, Any], payload: bytes, expect: type[M] | None = None, *, where: str = "a peer"
) -> Any:
    """The message of a frame: its header plus, if the class has one, its payload field."""
    name = header.get("type") if isinstance(header, dict) else None
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    field = getattr(cls, "PAYLOAD", None) if cls is not None else None
    if field is not None:
        if field in header:
            raise ProtocolError(f"{where} sent {name!r} with {field!r} in its header")
        try:
            header = {**header, field: unpack(payload) if payload else None}
        except Exception as exc:  # msgpack raises several types for bad bytes
            raise ProtocolError(
                f"{where} sent {name!r} with an unreadable payload: {exc}"
            ) from None
    elif payload:
        raise ProtocolError(f"{where} sent {name!r} with a payload it does not have")
    return decode(header, expect, where=where)


def _decode_fields(cls: Any, raw: dict[str, Any], where: str) -> Any:
    fields, known = _plan(cls)
    if not known.issuperset(raw):
        unknown = set(raw) - known
        raise ProtocolError(f"{where} sent {cls.TYPE!r} with unknown field(s) {sorted(unknown)}")
    values = {}
    for name, convert, required in fields:
        if name not in raw:
            if required:
                raise ProtocolError(f"{where} sent {cls.TYPE!r} without its field {name!r}")
            continue
        values[name] = convert(raw[name], f"{cls.TYPE}.{name}", where)
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:  # a __post_init__ check
        raise ProtocolError(f"{where} sent an invalid {cls.TYPE!r}: {exc}") from None


@functools.cache
def _fields(cls: Any) -> dict[str, tuple[Any, bool]]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out[f.name] = (hints[f.name], required)
    return out


_Convert = Callable[[Any, str, str], Any]


@functools.cache
def _plan(cls: Any) -> tuple[list[tuple[str, _Convert, bool]], frozenset[str]]:
    """Per field of ``cls``: its name, its compiled check (``_converter``), whether required;
    and every key a map of ``cls`` may have."""
    fields = [(name, _converter(hint), req) for name, (hint, req) in _fields(cls).items()]
    return fields, frozenset(_fields(cls)) | ENVELOPE


def _from_wire(value: Any, hint: Any, path: str, where: str) -> Any:
    """``value`` checked against (and converted to) the type ``hint``."""
    return _converter(hint)(value, path, where)


@functools.cache
def _converter(hint: Any) -> _Convert:
    """The check of a value against ``hint``, compiled once per type: the type hints are read
    when a class is first decoded, not for every value (the coordinator decodes a thousand
    reports a second; reading the hints was a fifth of its time)."""
    if hint is Any:
        return _as_is
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _union(typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return _sequence(list, _converter(item))
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return _sequence(tuple, _converter(args[0]))
        return _fixed_tuple([_converter(a) for a in args])
    if origin is frozenset:
        (item,) = typing.get_args(hint)
        return _sequence(frozenset, _converter(item))
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        return _mapping(_converter(key_type), _converter(value_type))
    if isinstance(hint, type):
        name = getattr(hint, "TYPE", "")
        if name and dataclasses.is_dataclass(hint):
            return _nested(hint, name)
        if hasattr(hint, "from_msg"):
            return _compact(hint)
        if hasattr(hint, "__members__"):
            return _enum(hint)
        return _scalar(hint)
    raise TypeError(f"message field type {hint!r} is not supported by the codec")


def _as_is(value: Any, path: str, where: str) -> Any:
    return value


def _union(options: tuple[Any, ...]) -> _Convert:
    nullable = type(None) in options
    converters = [_converter(o) for o in options if o is not type(None)]

    def convert(value: Any, path: str, where: str) -> Any:
        if value is None and nullable:
            return None
        errors = []
        for option in converters:
            try:
                return option(value, path, where)
            except ProtocolError as exc:
                errors.append(str(exc))
        raise ProtocolError(errors[0] if len(errors) == 1 else f"{where} sent a bad {path}")

    return convert


def _sequence(kind: type[Any], item: _Convert) -> _Convert:
    def convert(value: Any, path: str, where: str) -> Any:
        _expect(value, list, path, where)
        if item is _as_is:
            return value if kind is list else kind(value)
        inner = f"{path}[]"
        return kind([item(v, inner, where) for v in value])

    return convert


def _fixed_tuple(items: list[_Convert]) -> _Convert:
    def convert(value: Any, path: str, where: str) -> Any:
        _expect(value, list, path, where)
        if len(value) != len(items):
            raise ProtocolError(f"{where} sent {path} with {len(value)} items, not {len(items)}")
        inner = f"{path}[]"
        return tuple(c(v, inner, where) for v, c in zip(value, items, strict=True))

    return convert


def _mapping(key: _Convert, item: _Convert) -> _Convert:
    def convert(value: Any, path: str, where: str) -> Any:
        _expect(value, dict, path, where)
        inner = f"{path} key"
        return {key(k, inner, where): item(v, f"{path}[{k!r}]", where) for k, v in value.items()}

    return convert


def _nested(hint: type[Any], name: str) -> _Convert:
    def convert(value: Any, path: str, where: str) -> Any:
        if not isinstance(value, dict) or value.get("type") != name:
            raise ProtocolError(f"{where} sent a bad {path}: not a {name!r}")
        return _decode_fields(hint, value, where)

    return convert


def _compact(hint: Any) -> _Convert:
    def convert(value: Any, path: str, where: str) -> Any:
        try:
            return hint.from_msg(value)
        except PeerckptError as exc:
            raise ProtocolError(f"{where} sent a bad {path}: {exc}") from None
        except Exception as exc:  # a malformed compact record: any shape of wrong
            raise ProtocolError(f"{where} sent a bad {path}: {type(exc).__name__}: {exc}") from None

    return convert


def _enum(hint: Any) -> _Convert:
    def convert(value: Any, path: str, where: str) -> Any:
        try:
            return hint(value)
        except ValueError:
            raise ProtocolError(f"{where} sent {path} = {value!r}, not a known value") from None

    return convert


def _scalar(hint: type[Any]) -> _Convert:
    if hint is int:

        def integer(value: Any, path: str, where: str) -> Any:
            if type(value) is int:
                return value
            if isinstance(value, bool):
                raise ProtocolError(f"{where} sent {path} as a bool where an int belongs")
            _expect(value, int, path, where)
            return value

        return integer
    if hint is float:

        def real(value: Any, path: str, where: str) -> Any:
            if isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            _expect(value, float, path, where)
            return value

        return real

    def other(value: Any, path: str, where: str) -> Any:
        _expect(value, hint, path, where)
        return value

    return other


def _expect(value: Any, kind: type[Any], path: str, where: str) -> None:
    if not isinstance(value, kind):
        raise ProtocolError(
            f"{where} sent {path} as {type(value).__name__} where {kind.__name__} belongs"
        )


# -- dispatch -------------------------------------------------------------------------------
class Dispatch(Generic[R]):
    """A receiver's table: message class → handler. ``handle`` refuses what it does not know.

    ``handle(msg, *context)`` calls ``table[type(msg)](msg, *context)``: the context is what
    the receiver knows of where the message came from (a connection, a link).
    """

    def __init__(self, table: dict[type[Any], Callable[..., R]], receiver: str) -> None:
        self.table = table
        self.receiver = receiver

    def __contains__(self, cls: type[Any]) -> bool:
        return cls in self.table

    def handle(self, msg: Any, *context: Any) -> R:
        handler = self.table.get(type(msg))
        if handler is None:
            raise ProtocolError(f"{self.receiver} does not handle {type_name(type(msg))!r}")
        return handler(msg, *context)
