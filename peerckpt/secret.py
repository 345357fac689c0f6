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
import stat
from collections.abc import Mapping

from peerckpt.errors import ConfigurationError

ENV = "PEERCKPT_SECRET"
FILE_ENV = "PEERCKPT_SECRET_FILE"  # the path of a 0600 file holding it (torchrun jobs)
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
    """The job's secret from ``PEERCKPT_SECRET`` (hex), else from the file named by
    ``PEERCKPT_SECRET_FILE``; ConfigurationError naming the variable and the fix if it is
    missing, not hex, empty or shorter than 16 bytes."""
    env = os.environ if environ is None else environ
    text = env.get(ENV)
    if text is None:
        path = env.get(FILE_ENV)
        if path:
            return secret_from_file(path)
        raise ConfigurationError(f"{ENV} is not set (nor {FILE_ENV}). {_FIX}")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ConfigurationError(f"{ENV} must hold the job's secret in hex. {_FIX}") from None
    return check_secret(secret)


def secret_from_file(path: str) -> bytes:
    """The job's secret (hex) from a file that belongs to the caller and that only the caller
    can read (mode 0600: a secret on a command line would show in ``ps``); ConfigurationError
    naming the file and the fix otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the job's secret from {path}: {exc.strerror}; give a regular file "
            "holding the secret in hex"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigurationError(
                f"the secret file {path} must be a regular file of yours that only you can "
                f"read; run `chmod 600 {path}`"
            )
        raw = f.read(4096)
    try:
        secret = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ConfigurationError(f"the secret file {path} must hold the secret in hex") from None
    return check_secret(secret, path)


def job_secret(secret_file: str | None = None) -> bytes:
    """The job's secret for a process that joins a job from outside: ``secret_file`` if given,
    else ``PEERCKPT_SECRET``."""
    return secret_from_file(secret_file) if secret_file else secret_from_env()
