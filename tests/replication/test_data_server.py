"""The data server's side of the wire protocol: secrets and frame sizes checked first."""

from __future__ import annotations

import struct

import pytest

from peerckpt.errors import AuthenticationError
from peerckpt.manifest import ChunkRecord, SnapshotManifest
from peerckpt.messages.data import Push, Ready
from peerckpt.wire import MAGIC, connect_tcp, pack


def test_wrong_secret_against_a_real_data_server(peers, job) -> None:
    name, _ = job
    with pytest.raises(AuthenticationError, match="job secret does not match"):
        connect_tcp(peers[0].server.address, b"not the secret" * 3, name)


def test_frame_larger_than_its_destination_is_rejected_before_any_payload(peers, job) -> None:
    """A data frame that declares more bytes than the replica slot holds is refused at once.

    The client sends only the header and no payload at all: if the server tried to read the
    payload it would block, and the reply below would never come.
    """
    name, secret = job
    conn = connect_tcp(peers[1].server.address, secret, name)
    chunks = (ChunkRecord("__meta__", "uint8", (4096,), (0,), (4096,), 0, 4096, 0),)
    manifest = SnapshotManifest(rank=0, step=3, epoch=0, chunks=chunks, used_bytes=4096)
    conn.sock.settimeout(10)
    conn.send_msg(Push(0, 0, 0, None, manifest))
    conn.recv_msg(Ready)  # the buddy allocated the slot
    header = pack({"type": "data", "off": 0, "len": 1 << 30})
    conn.sock.sendall(struct.pack("!4sI", MAGIC, len(header)) + header)
    error, _ = conn.recv_message()
    assert error["type"] == "error" and error["code"] == "frame_too_large"
    assert "destination holds" in error["message"]
    assert peers[1].store.find(0, 0, 3) is None  # nothing half-written is ever readable
    conn.close()
