"""Authentication of each gRPC call: a MAC over the call itself, fresh every time.

A call carries, in its ``peerckpt-auth`` metadata, ``v2 <time> <nonce> <mac>``::

    mac = HMAC-SHA256(secret, "peerckpt-rpc-v2" | job | method | time | nonce | SHA-256(body))

``body`` is the request's bytes exactly as they travel. The server (``CallVerifier``) checks
the MAC before anything else, then that ``time`` is within ``window_s`` of its own clock,
then that the nonce was never seen within the window (a bounded replay cache, cleared as the
window moves on). So a call seen on the network cannot be sent again (replay), nor its body
changed (tampering), nor its method, nor replayed later than the window; and a stranger
cannot fill the cache, since only calls that prove the secret enter it.

Before this, every call carried ``HMAC(secret, job:method)``, a static bearer token: one
captured call let anyone replay any call of that method.

The coordinator proves the secret too: every reply carries, in its trailing metadata
``peerckpt-proof``, ``HMAC(secret, "peerckpt-rpc-reply-v2" | job | method | nonce | seq |
SHA-256(reply))`` over the request's own nonce (``seq`` -1 for a unary reply or an error's
text, 0, 1, … for a stream's events, each sent with its own proof), and the caller checks it
before it reads a byte of the reply. Without TLS (every single-host run) nothing else proved
it: when the coordinator died and was restarted on the same ports, another local user bound
both ports 39 ms after the kill and received the job's signed calls, answering as it liked
(audit of 2026-11-27). A restarted coordinator also refuses every call made before it
started (``not_before``): a call captured from its predecessor cannot be replayed to it
within the window.

This module owns the MACs and the cache only; it never decodes a body. Both helpers are plain
objects, so they compose with any gRPC server (a handler wrapper or an interceptor).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from peerckpt.errors import AuthenticationError

AUTH_KEY = "peerckpt-auth"
_VERSION = "v2"
_DOMAIN = b"peerckpt-rpc-v2"


PROOF_KEY = "peerckpt-proof"
_REPLY_DOMAIN = b"peerckpt-rpc-reply-v2"
START_SLACK_S = 0.5  # calls made this long before a coordinator started are still taken


def reply_proof(secret: bytes, job: str, method: str, nonce: str, seq: int, body: bytes) -> str:
    """What proves that a reply (``seq`` -1) or a stream's ``seq``-th event to the call with
    ``nonce`` comes from a process holding the secret."""
    digest = hashlib.sha256(body).digest()
    parts = [_REPLY_DOMAIN, job.encode(), method.encode(), nonce.encode(), str(seq).encode()]
    return hmac.new(secret, b"|".join([*parts, digest]), hashlib.sha256).hexdigest()


def nonce_of(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The nonce of a call's authentication metadata, or None."""
    value = next((v for k, v in metadata if k == AUTH_KEY), None)
    parts = value.split(" ") if isinstance(value, str) else []
    return parts[2] if len(parts) == 4 else None


def _mac(secret: bytes, job: str, method: str, stamp: str, nonce: str, body: bytes) -> str:
    digest = hashlib.sha256(body).digest()
    parts = [_DOMAIN, job.encode(), method.encode(), stamp.encode(), nonce.encode(), digest]
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).hexdigest()


class CallSigner:
    """The client's half: the metadata of one call of ``method`` with ``body``."""

    def __init__(self, secret: bytes, job: str) -> None:
        self._secret = secret
        self._job = job

    def item(self, nonce: str, seq: int, method: str, body: bytes) -> str:
        """The MAC of item ``seq`` (a call of ``method``) on a stream opened with ``nonce``."""
        return item_mac(self._secret, self._job, nonce, seq, method, body)

    def metadata(self, method: str, body: bytes) -> tuple[tuple[str, str], ...]:
        stamp = f"{time.time():.3f}"
        nonce = os.urandom(16).hex()
        mac = _mac(self._secret, self._job, method, stamp, nonce, body)
        return ((AUTH_KEY, f"{_VERSION} {stamp} {nonce} {mac}"),)

    def check_reply(
        self,
        method: str,
        metadata: Iterable[tuple[str, str | bytes]],
        seq: int,
        body: bytes,
        proof: Any,
        where: str,
    ) -> None:
        """Raise AuthenticationError unless ``proof`` proves that ``body`` (the reply, an
        error's text, or event ``seq``) comes from a holder of the secret, for this call."""
        nonce = nonce_of(metadata)
        expected = reply_proof(self._secret, self._job, method, nonce or "", seq, body)
        if not isinstance(proof, str) or not hmac.compare_digest(expected, proof):
            raise AuthenticationError(
                f"{where} did not prove the job's secret in its answer to {method}: another "
                "process listens on the coordinator's address (its own was restarted, and "
                "someone else took the port?), or a coordinator of another job or version. "
                "Its answer is ignored; check the address and PEERCKPT_SECRET"
            )


class CallVerifier:
    """The server's half: ``verify`` raises AuthenticationError, naming why, for a call that
    does not prove the secret, is too old or too new, or was seen before.

    ``window_s``: how far a call's time may be from this host's clock (hosts' clocks must
    agree that closely); ``max_calls``: the most calls remembered (a full cache refuses new
    calls rather than forgetting one still inside the window).
    """

    def __init__(
        self,
        secret: bytes,
        job: str,
        window_s: float = 30.0,
        max_calls: int = 1 << 20,
        not_before: float | None = None,
    ) -> None:
        """``not_before``: calls made before this time are refused (default: when this
        verifier was made, less ``START_SLACK_S``): replays from before a restart."""
        self._secret = secret
        self._job = job
        self.not_before = time.time() - START_SLACK_S if not_before is None else not_before
        self.window_s = window_s
        self._max = max_calls
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # a heap: (when to forget, nonce)

    def verify(self, method: str, metadata: Iterable[tuple[str, str | bytes]], body: bytes) -> None:
        value = next((v for k, v in metadata if k == AUTH_KEY), None)
        parts = value.split(" ") if isinstance(value, str) else []
        if len(parts) != 4 or parts[0] != _VERSION:
            raise AuthenticationError(
                f"call to {method} refused: it carries no peerckpt v2 authentication (a process "
                "of an older peerckpt version, or not a peerckpt process). Run every process of "
                "a job from the same version with the same PEERCKPT_SECRET."
            )
        _, stamp, nonce, mac = parts
        expected = _mac(self._secret, self._job, method, stamp, nonce, body)
        if not hmac.compare_digest(expected, mac):
            raise AuthenticationError(
                f"call to {method} refused: wrong job secret, another job's coordinator, or a "
                "body changed in transit. Start every process of a job with the same "
                "PEERCKPT_SECRET."
            )
        try:
            sent = float(stamp)
        except ValueError:
            raise AuthenticationError(f"call to {method} refused: a bad time {stamp!r}") from None
        now = time.time()
        if sent < self.not_before:
            raise AuthenticationError(
                f"call to {method} refused: made {self.not_before - sent:.1f} s before this "
                "coordinator started: a call to its predecessor, replayed"
            )
        if abs(now - sent) > self.window_s:
            raise AuthenticationError(
                f"call to {method} refused: it was made {now - sent:+.1f} s from this host's "
                f"clock (limit ±{self.window_s:g} s): a replayed call, or hosts whose clocks "
                "disagree; synchronise them (NTP)"
            )
        self._remember(method, nonce, sent + self.window_s, now)

    def _remember(self, method: str, nonce: str, forget_at: float, now: float) -> None:
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if nonce in self._seen:
                raise AuthenticationError(
                    f"call to {method} refused: replayed (its nonce was already used)"
                )
            if len(self._seen) >= self._max:
                raise AuthenticationError(
                    f"call to {method} refused: more than {self._max} calls within "
                    f"{self.window_s:g} s; try again"
                )
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (forget_at, nonce))


_ITEM_DOMAIN = b"peerckpt-rpc-item-v1"


def item_mac(secret: bytes, job: str, nonce: str, seq: int, method: str, body: bytes) -> str:
    """The MAC of item ``seq`` of a stream of calls (``peerckpt/rpcstream.py``) opened with
    ``nonce``: one call of ``method`` with ``body``. The stream's opening is checked like any
    call (time, nonce never seen); its items are bound to it and to their place in it, so an
    item can be neither changed, replayed, reordered nor moved to another stream."""
    digest = hashlib.sha256(body).digest()
    parts = [_ITEM_DOMAIN, job.encode(), nonce.encode(), str(seq).encode(), method.encode()]
    return hmac.new(secret, b"|".join([*parts, digest]), hashlib.sha256).hexdigest()


def check_item(
    secret: bytes, job: str, nonce: str, seq: int, method: str, body: bytes, mac: Any
) -> None:
    """Raise AuthenticationError unless ``mac`` is ``item_mac`` of this item."""
    expected = item_mac(secret, job, nonce, seq, method, body)
    if not isinstance(mac, str) or not hmac.compare_digest(expected, mac):
        raise AuthenticationError(
            f"call {seq} ({method}) on a stream refused: its MAC does not prove the job's "
            "secret for this stream and place (changed, replayed or moved in transit)"
        )


_ADDRESS_DOMAIN = b"peerckpt-coordinator-address-v1"


def sign_address(secret: bytes, job: str, address: str) -> str:
    """``address`` as published where anyone may write (torchrun's store): with a MAC."""
    mac = hmac.new(secret, b"|".join([_ADDRESS_DOMAIN, job.encode(), address.encode()]), "sha256")
    return f"{address} {mac.hexdigest()}"


def open_address(secret: bytes, job: str, value: str, where: str) -> str:
    """The coordinator's address ``sign_address`` published, or AuthenticationError: a
    value written by a process without the secret (the store takes anyone's writes)."""
    address = value.strip().partition(" ")[0]
    if not address or not hmac.compare_digest(sign_address(secret, job, address), value.strip()):
        raise AuthenticationError(
            f"the coordinator's address in {where} is not signed with this job's secret "
            f"({value[:80]!r}): written by a process outside the job, or by a host started "
            "with another PEERCKPT_SECRET; start every host with the job's secret"
        )
    return address
