"""The job's secret as a process receives it: ``PEERCKPT_SECRET`` (hex) or a 0600 file.

Every authenticated link of a job proves knowledge of one shared secret. A process started by
``peerckpt run`` gets it from its launcher; a process started some other way (torchrun on
every host) gets the same value from its environment or from a file only its user can read,
never from a command line (it would show in ``ps``). Pure functions; nothing here connects.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from peerckpt.errors import ConfigurationError

ENV = "PEERCKPT_SECRET"
FILE_ENV = "PEERCKPT_SECRET_FILE"
MIN_SECRET_BYTES = 16
_FIX = (
    f"give every process of the job the same random value in {ENV} (hex), e.g. "
    "`python -c 'import secrets; print(secrets.token_hex(32))'`, or the path of a file "
    f"holding it (mode 0600) in {FILE_ENV}"
)


def check_secret(secret: bytes, what: str = ENV) -> bytes:
    """``secret`` if it is long enough to be a job's secret; ConfigurationError otherwise."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigurationError(
            f"{what} holds {len(secret)} byte(s); a job's secret must have at least "
            f"{MIN_SECRET_BYTES} random bytes. {_FIX}"
        )
    return secret


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """The job's secret from ``PEERCKPT_SECRET`` (hex), else from the file named by
    ``PEERCKPT_SECRET_FILE``; ConfigurationError naming the variables and the fix."""
    env = os.environ if environ is None else environ
    text = env.get(ENV)
    if text is None:
        path = env.get(FILE_ENV)
        if path:
            return secret_from_file(path)
        raise ConfigurationError(f"neither {ENV} nor {FILE_ENV} is set: {_FIX}")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ConfigurationError(f"{ENV} must hold the job's secret in hex: {_FIX}") from None
    return check_secret(secret)


def secret_from_file(path: str) -> bytes:
    """The job's secret (hex) from a regular file of the caller's that only the caller can
    read (mode 0600); ConfigurationError naming the file and the fix otherwise."""
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
