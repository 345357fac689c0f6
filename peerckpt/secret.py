"""The job's secret as a process receives it, checked: from an inherited descriptor
(``PEERCKPT_SECRET_FD``, how ``peerckpt run`` hands it to the processes it starts), from
``PEERCKPT_SECRET`` (a user's own setting), or from a 0600 file (``PEERCKPT_SECRET_FILE``).

Every authenticated link of a job (``wire.py``'s handshake, ``rpc.py``'s calls) proves
knowledge of one shared secret, so a weak one weakens all of them: an empty secret is known
to everyone, and a short one can be guessed. ``peerckpt run`` makes 32 random bytes; a
secret given some other way (a hand-set environment, a job file) must have at least
:data:`MIN_SECRET_BYTES`. Every process reads it through :func:`secret_from_env`.

A descriptor leaves nothing behind: the launcher writes the secret into a pipe, the child
inherits its read end (``pass_fds``), reads it once and closes it, and drops the variable, so
neither the process's environment (``/proc/PID/environ``, a tool that dumps it) nor anything
the process starts (the user's subprocesses, DataLoader workers) holds the key.

Nothing here opens a connection.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping

from peerckpt.errors import ConfigurationError

ENV = "PEERCKPT_SECRET"
FILE_ENV = "PEERCKPT_SECRET_FILE"  # the path of a 0600 file holding it (torchrun jobs)
FD_ENV = "PEERCKPT_SECRET_FD"  # an inherited descriptor to read it from, once
NAMES = (ENV, FD_ENV, FILE_ENV)  # where a process may find it
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


# descriptor → what was read from it, once (a number open again is another descriptor)
_from_fd: dict[int, bytes] = {}


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """The job's secret from ``PEERCKPT_SECRET`` (hex), else from the descriptor named by
    ``PEERCKPT_SECRET_FD``, else from the file named by ``PEERCKPT_SECRET_FILE``;
    ConfigurationError naming the variable and the fix if it is missing, not hex, empty or
    shorter than 16 bytes."""
    env = os.environ if environ is None else environ
    text = env.get(ENV)
    if text is None:
        if env.get(FD_ENV):
            secret = _secret_from_fd(env[FD_ENV])
            if env is os.environ:
                os.environ.pop(FD_ENV, None)
            return secret
        path = env.get(FILE_ENV)
        if path:
            return secret_from_file(path)
        raise ConfigurationError(f"{ENV} is not set (nor {FD_ENV} or {FILE_ENV}). {_FIX}")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ConfigurationError(f"{ENV} must hold the job's secret in hex. {_FIX}") from None
    return check_secret(secret)


def _secret_from_fd(text: str) -> bytes:
    try:
        fd = int(text)
    except ValueError:
        raise ConfigurationError(f"{FD_ENV} must name a file descriptor, not {text!r}") from None
    if fd in _from_fd and not _is_open(fd):  # read before (and closed since): the same
        return _from_fd[fd]
    chunks: list[bytes] = []
    try:
        while sum(map(len, chunks)) < 4096:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the job's secret from descriptor {fd} ({FD_ENV}): {exc.strerror}; "
            "it is handed to the processes a peerckpt launcher starts, once: start this "
            "process with `peerckpt run`, or give PEERCKPT_SECRET or PEERCKPT_SECRET_FILE"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    try:
        secret = bytes.fromhex(b"".join(chunks).decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ConfigurationError(
            f"descriptor {fd} ({FD_ENV}) must hold the secret in hex"
        ) from None
    _from_fd[fd] = check_secret(secret, FD_ENV)
    return _from_fd[fd]


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def secret_pipe(secret: bytes) -> int:
    """The read end of a pipe that holds ``secret`` (hex) and then its end: a child started
    with it in ``pass_fds`` and ``PEERCKPT_SECRET_FD`` set to it reads the secret there. The
    caller closes it once the child is started."""
    text = secret.hex().encode()
    read, write = os.pipe()
    try:
        os.write(write, text)  # 64 bytes: far below a pipe's buffer, never blocks
    finally:
        os.close(write)
    return read


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
