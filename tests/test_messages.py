"""Typed messages: one codec, checked at the edge; whatever arrives, a message or ProtocolError."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerckpt.codec import pack, unpack
from peerckpt.errors import ProtocolError
from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.membership import Membership, RankAssignment
from peerckpt.messages import _REGISTRY, Dispatch, decode, encode, from_frame, to_frame
from peerckpt.messages.control import (
    Commit,
    EpochOpened,
    JobStatus,
    Pull,
    RecoveryEvent,
    Replicated,
    ReplicatedReply,
    Shutdown,
    Status,
    reply_class,
)
from peerckpt.messages.data import FetchBoxes, Push
from peerckpt.messages.local import EpochStart, RestoreBody, RestorePlan, SnapshotTaken
from peerckpt.states import EpochMode, JobState, RecoveryKind

MANIFEST = SnapshotManifest(
    rank=1,
    step=7,
    epoch=2,
    chunks=(ChunkRecord("w", "float32", (4, 2), (0, 0), (4, 2), 0, 32, 123),),
    used_bytes=32,
)
MEMBERSHIP = Membership(
    epoch=2,
    world_size=2,
    ranks={0: RankAssignment(0, 0, 10), 1: RankAssignment(1, 1, 11)},
    placement={0: [1], 1: [0]},
    restore_step=7,
    sources={0: [0, 1], 1: [1, 0]},
    node_addrs={0: "127.0.0.2:1", 1: "127.0.0.3:1"},
    store_addr="127.0.0.2:2",
    mode=EpochMode.SAME,
    gen=1,
)
SAMPLES = [
    Commit(3, 9),
    Shutdown(JobState.FAILED, "why"),
    EpochOpened(MEMBERSHIP),
    Replicated(0, 2, 1, 7, [0, 1], 32, 8, "abc", [c.to_msg() for c in MANIFEST.chunks]),
    EpochStart(
        2,
        1,
        2,
        0,
        1,
        "s:1",
        ["127.0.0.2"],
        RestorePlan(EpochMode.SAME, 7, 0, "/p"),
        RestoreBody(MANIFEST, None),
    ),
    SnapshotTaken(2, 1, 7, 0, MANIFEST),
    Push(2, 1, 1, None, MANIFEST),
    FetchBoxes(2, 1, 7, [(0, "w", [[0], [4]], [[0], [2]])]),
    JobStatus(
        "j",
        JobState.RUNNING,
        "",
        2,
        2,
        None,
        7,
        {0: 7},
        {0: [0, 10]},
        [[2, 20]],
        {0: True},
        [
            RecoveryEvent(
                RecoveryKind.RANK, [1], [], "exited", {1: 1}, 1.5, 1, pulls=[Pull(1, 2, 0, 32, 0.1)]
            )
        ],
        [],
        [],
    ),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_round_trip_through_msgpack(msg) -> None:
    raw = unpack(pack(encode(msg)))
    assert decode(raw, type(msg)) == msg
    header, payload = to_frame(msg)
    header = unpack(pack(header))
    assert from_frame(header, payload or b"", type(msg)) == msg


def test_a_field_of_the_wrong_type_is_named() -> None:
    raw = encode(Commit(3, 9))
    raw["step"] = "nine"
    with pytest.raises(ProtocolError, match=r"commit\.step as str where int belongs"):
        decode(raw, Commit)


def test_missing_unknown_and_unexpected_messages_are_refused() -> None:
    with pytest.raises(ProtocolError, match="without its field 'step'"):
        decode({"type": "commit", "epoch": 1}, Commit)
    with pytest.raises(ProtocolError, match=r"unknown field\(s\) \['color'\]"):
        decode({"type": "commit", "epoch": 1, "step": 2, "color": "red"}, Commit)
    with pytest.raises(ProtocolError, match="unknown message type 'nope'"):
        decode({"type": "nope"})
    with pytest.raises(ProtocolError, match="was expected"):
        decode(encode(Commit(1, 2)), Status)


def test_an_enum_value_that_does_not_exist_is_refused() -> None:
    raw = encode(Shutdown(JobState.FAILED, "x"))
    raw["state"] = "exploded"
    with pytest.raises(ProtocolError, match="not a known value"):
        decode(raw, Shutdown)


def test_requests_name_their_reply_class() -> None:
    assert reply_class(Replicated) is ReplicatedReply
    assert reply_class(Status) is JobStatus


def test_a_dispatch_table_refuses_what_it_does_not_handle() -> None:
    seen = []
    table = Dispatch[None]({Commit: seen.append}, "a test receiver")
    table.handle(Commit(1, 2))
    assert seen == [Commit(1, 2)]
    with pytest.raises(ProtocolError, match="a test receiver does not handle 'shutdown'"):
        table.handle(Shutdown(JobState.STOPPED))


def test_every_registered_message_is_a_frozen_dataclass() -> None:
    for name, cls in _REGISTRY.items():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name


# -- fuzzing ----------------------------------------------------------------------------------
_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.integers() | st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def _message_like(draw: st.DrawFn) -> dict:
    """A map that names a real message type and (mostly) its real fields, with any values."""
    name = draw(st.sampled_from(sorted(_REGISTRY)))
    fields = [f.name for f in dataclasses.fields(_REGISTRY[name])]
    names = st.sampled_from(fields) | st.text(max_size=5) if fields else st.text(max_size=5)
    keys = draw(st.lists(names, max_size=len(fields) + 2))
    raw = {k: draw(_values) for k in keys}
    raw["type"] = name
    return raw


def _check(raw: object) -> None:
    try:
        msg = decode(raw)
    except ProtocolError:
        return
    assert raw["type"] == type(msg).TYPE  # type: ignore[index]


_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(_message_like())
def test_any_map_naming_a_message_decodes_or_raises_protocol_error(raw) -> None:
    _check(raw)


@_FUZZ
@given(_values)
def test_any_value_at_all_decodes_or_raises_protocol_error(raw) -> None:
    _check(raw)


@_FUZZ
@given(st.binary(max_size=64), st.sampled_from(["snapshot", "epoch", "push", "staging"]))
def test_any_payload_of_a_framed_message_decodes_or_raises_protocol_error(payload, name) -> None:
    header = {k: v for k, v in encode(SAMPLES[5]).items() if k != "manifest"}
    header["type"] = name
    try:
        from_frame(header, payload)
    except ProtocolError:
        pass


@pytest.mark.slow
@settings(max_examples=20_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_message_like())
def test_any_map_naming_a_message_long_run(raw) -> None:
    _check(raw)
