"""The job's secret as a process receives it: from ``PEERCKPT_SECRET``, checked.

Every authenticated link of a job (``wire.py``'s handshake, ``rpc.py``'s calls) proves
knowledge of one shared secret, so a weak one weakens all of them: an empty secret is known
to everyone, and a short one can be guessed. ``peerckpt run`` makes 32 random bytes; a
secret given some other way (a hand-set environment, a job file) must have at least
:data:`MIN_SECRET_BYTES`. Every process reads it through :func:`secret_from_env`.

Pure functions; nothing here opens a connection.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from peerckpt.errors import ConfigurationError

ENV = "PEERCKPT_SECRET"
MIN_SECRET_BYTES = 16
_FIX = (
    "`peerckpt run` sets it for the processes it starts; to set it yourself, give every "
    "process of the job the same random value, e.g. "
    "`python -c 'import secrets; print(secrets.token_hex(32))'`"
)


def check_secret(secret: bytes, what: str = ENV) -> bytes:
    """``secret`` if it is long enough to be a job's secret; ConfigurationError otherwise."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigurationError(
            f"{what} holds {len(secret)} byte(s); a job's secret must have at least "
            f"{MIN_SECRET_BYTES} random bytes ({2 * MIN_SECRET_BYTES} hex digits). {_FIX}"
        )
    return secret


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """The job's secret from ``PEERCKPT_SECRET`` (hex); ConfigurationError naming the
    variable and the fix if it is missing, not hex, empty or shorter than 16 bytes."""
    env = os.environ if environ is None else environ
    text = env.get(ENV)
    if text is None:
        raise ConfigurationError(f"{ENV} is not set. {_FIX}")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ConfigurationError(f"{ENV} must hold the job's secret in hex. {_FIX}") from None
    return check_secret(secret)
