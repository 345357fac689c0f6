"""What the Ray driver sends each host's actor, sealed to that actor: the job's secret, the
host's orders (the spec: its ``--persist`` URL, which may hold credentials) and the launching
shell's environment (which may hold ``AWS_SECRET_ACCESS_KEY``).

Ray carries actor arguments over its own RPC, unencrypted unless the cluster runs with Ray's
TLS (``RAY_USE_TLS``): the job's secret passed as an argument could be read off the network
by anyone on the path (audit of 2026-11-27). So::

    driver                                          RayHost actor on node k
      │  public_key()  ───────────────────────────▶  makes an X25519 key pair (its own,
      │  ◀───────────────────────────────── pub_k    in memory only, one per actor)
      │  seal(payload, pub_k, context):
      │    ephemeral X25519 key e; key = HKDF-SHA256(X25519(e, pub_k), context, pub_e, pub_k)
      │    AES-256-GCM(key, nonce, payload, associated data = context)
      │  start({pub_e, nonce, ciphertext})  ───────▶  open: the same key from (k, pub_e);
      │                                               the tag proves nothing was changed

``context`` is ``peerckpt-ray-orders-v1|job|host``: a sealed order opens only for the actor it
was made for. Someone who reads Ray's traffic sees two public keys and a ciphertext.

Why not a key derived from the secret, sent in its place: the hosts run the coordinator, the
agents and the ranks, and those prove the job's secret to each other (the handshake's HMACs,
the gRPC MACs, the TLS CA derived from it) and to the driver, whose calls the coordinator
checks with the same secret. Whatever key the hosts were given, every process of the job
would have to hold it and prove it — it would *be* the job's secret under another name, and
whoever read it off Ray's RPC would be a member of the job as surely. A derived key protects
only what its holders cannot do; here they must do everything.

What this does not stop: someone who can *talk* to the Ray cluster (submit a task, or change
Ray's messages in flight) runs code as the job's user on every node — Ray has no
authentication of its own — and can read the secret from a process's environment. A job that
must withstand that needs a network only the cluster reaches, or Ray's TLS, which
authenticates Ray's peers (docs/security.md, "Ray").
"""

from __future__ import annotations

import json
import os
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from peerckpt.errors import AuthenticationError

_LABEL = b"peerckpt-ray-orders-v1"
_RAW = (serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def context(job: str, host: int) -> bytes:
    """What binds a sealed order to one job's host."""
    return b"|".join([_LABEL, job.encode(), str(host).encode()])


def _key(shared: bytes, ctx: bytes, sender: bytes, receiver: bytes) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=ctx + sender + receiver)
    return hkdf.derive(shared)


def seal(payload: dict[str, Any], public: bytes, ctx: bytes) -> dict[str, bytes]:
    """``payload`` (JSON-able) sealed to the actor whose public key is ``public``."""
    ephemeral = X25519PrivateKey.generate()
    sender = ephemeral.public_key().public_bytes(*_RAW)
    key = _key(ephemeral.exchange(X25519PublicKey.from_public_bytes(public)), ctx, sender, public)
    nonce = os.urandom(12)
    body = AESGCM(key).encrypt(nonce, json.dumps(payload).encode(), ctx)
    return {"sender": sender, "nonce": nonce, "body": body}


class Opener:
    """The actor's side: a key pair of its own, and the opening of what was sealed to it."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(*_RAW)

    def open(self, sealed: dict[str, bytes], ctx: bytes) -> dict[str, Any]:
        """The payload sealed to this actor for ``ctx``; AuthenticationError if it was
        sealed to another key or context, or changed on the way."""
        try:
            sender = X25519PublicKey.from_public_bytes(sealed["sender"])
            key = _key(self._private.exchange(sender), ctx, sealed["sender"], self.public)
            payload: dict[str, Any] = json.loads(
                AESGCM(key).decrypt(sealed["nonce"], sealed["body"], ctx)
            )
        except Exception as exc:
            raise AuthenticationError(
                f"the orders sent to this Ray host do not open ({type(exc).__name__}): they were "
                "sealed for another actor or job, or changed on the way; start the job again"
            ) from None
        return payload
