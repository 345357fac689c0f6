"""Messages of the data links between agents (TCP); bulk bytes travel raw beside them.

``replication/transfer.py`` draws the three exchanges (push, fetch, fetch_boxes);
``replication/devicepull.py`` the pull over a device link (fetch_device). ``Data``
and ``Box`` frames carry raw bytes as their payload, received straight into a slot after the
header's size is checked; every other message is a header alone. A refusal is a
``wire``-level ``error`` frame with a code (``peerckpt/wire.py``), not a message here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from peerckpt.manifest import SnapshotManifest
from peerckpt.messages import Message, message


class DataRequest(Message):
    """The first frame of an exchange on a data link."""


@message("push")
@dataclass(frozen=True)
class Push(DataRequest):
    """Replicate ``rank``'s snapshot ``manifest`` to the receiving buddy."""

    PAYLOAD = "manifest"

    epoch: int
    gen: int
    rank: int
    committed: int | None
    manifest: SnapshotManifest


@message("fetch")
@dataclass(frozen=True)
class Fetch(DataRequest):
    """Send ``rank``'s copy of ``step`` (layout generation ``gen``)."""

    epoch: int
    gen: int
    rank: int
    step: int


@message("fetch_device")
@dataclass(frozen=True)
class FetchDevice(DataRequest):
    """Send ``rank``'s copy of ``step`` over a device link (NCCL) whose rendezvous id is
    ``uid``; answered by ``manifest`` (accepted: open the link) or ``device_declined``
    (``replication/devicepull.py``)."""

    epoch: int
    gen: int
    rank: int
    step: int
    uid: bytes


@message("device_declined")
@dataclass(frozen=True)
class DeviceDeclined(Message):
    """The holder cannot send over a device link (``why``): ask again with ``fetch``."""

    why: str


@message("fetch_boxes")
@dataclass(frozen=True)
class FetchBoxes(DataRequest):
    """Send pieces of chunks: items ``[rank, chunk name, box, region]`` of ``step``."""

    PAYLOAD = "items"

    epoch: int
    gen: int
    step: int
    items: list[tuple[int, str, Any, Any]]


@message("ready")
@dataclass(frozen=True)
class Ready(Message):
    """The push's slot is allocated: send the bytes."""


@message("data")
@dataclass(frozen=True)
class Data(Message):
    """Bytes at ``off`` of a transfer (the payload, raw)."""

    off: int


@message("box")
@dataclass(frozen=True)
class Box(Message):
    """Item ``i`` of a fetch_boxes answer (the payload, raw), and its crc32c."""

    i: int
    crc: int


@message("end")
@dataclass(frozen=True)
class End(Message):
    """The last frame of a transfer; a push's carries every chunk's crc32c."""

    crcs: list[int] | None = None


@message("ack")
@dataclass(frozen=True)
class Ack(Message):
    """The buddy verified the push and keeps it."""


@message("manifest")
@dataclass(frozen=True)
class ManifestReply(Message):
    """The answer to a fetch, before its data frames."""

    PAYLOAD = "manifest"

    manifest: SnapshotManifest


# -- erasure coding (``--erasure K+M``; ``replication/parity.py`` draws the exchanges) --------
@message("parity_piece")
@dataclass(frozen=True)
class ParityPiece(DataRequest):
    """Fold piece ``piece`` of ``rank``'s snapshot of ``step`` (``length`` bytes, as data
    frames) into parity row ``row`` of stripe ``stripe`` of the coding group ``group`` (its
    ranks by position), which has ``k`` data pieces, times ``coef``. ``manifest``: the
    rank's, kept beside the parity (a rebuild needs it); its checksums come in ``end``.
    ``unfold``: take out the piece folded in before (the same bytes again), so that the rank's
    snapshot can be coded anew (whole, where it was coded without its twins' chunks)."""

    PAYLOAD = "manifest"
    epoch: int
    gen: int
    rank: int
    step: int
    committed: int | None
    group: list[int]
    stripe: int
    row: int
    piece: int
    k: int
    coef: int
    length: int
    manifest: SnapshotManifest
    unfold: bool = False


@message("fetch_parity")
@dataclass(frozen=True)
class FetchParity(DataRequest):
    """Send parity row ``row`` of stripe ``stripe`` of ``group`` for ``step``."""

    epoch: int
    gen: int
    group: list[int]
    stripe: int
    row: int
    step: int


@message("parity_reply")
@dataclass(frozen=True)
class ParityReply(Message):
    """The answer to a fetch_parity, before its data frames: the parity's length and
    crc32c (computed when its last piece was folded in), and the data ranks' manifests."""

    PAYLOAD = "manifests"
    length: int
    crc: int
    manifests: list[SnapshotManifest]


@message("fetch_ranges")
@dataclass(frozen=True)
class FetchRanges(DataRequest):
    """Send the byte ``ranges`` of ``rank``'s copy of ``step`` (a piece to decode with); the
    ``end`` frame carries their crc32c, as read."""

    epoch: int
    gen: int
    rank: int
    step: int
    ranges: list[tuple[int, int]]
