"""Files peerckpt writes for the user outside a job's own 0700 directory: reports, a
campaign's results, timelines. Each is written whole to a fresh private file beside its
destination (``mkstemp``: ``O_EXCL``, mode 0600) and renamed onto it: a link planted at the
destination is replaced, never followed (a campaign's fixed names in /tmp, written through
such a link, overwrote another user's ``~/.bashrc`` where ``fs.protected_symlinks=0``), and in
a shared directory such as /tmp another user's file there is not replaced (the rename is
refused: the sticky bit). Readers never see half a file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from peerckpt.errors import ConfigurationError


def write_private(path: str, data: bytes | str) -> None:
    """Write ``data`` to ``path`` (mode 0600), whole, without following a link there."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".peerckpt-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except PermissionError as exc:
        raise ConfigurationError(
            f"cannot write {path}: {exc.strerror} (another user's file there, in a shared "
            "directory?); give a path in a directory of your own"
        ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def private_dir(parent: str, prefix: str) -> str:
    """A new directory of this user's only (0700), in ``parent``, named ``prefix…``."""
    return tempfile.mkdtemp(prefix=prefix, dir=parent or ".")
