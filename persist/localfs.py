"""Local files of a durable checkpoint, opened so that nothing planted in the root redirects them.

The root may be on a file system other users (or other jobs) can write to; whatever sits in
it is input. So, on the local backend:

- Reading: a step's files are opened relative to the step directory, which is itself opened
  without following a link; each file with ``O_NOFOLLOW`` (a link is refused, never
  followed out of the root), ``O_NONBLOCK`` (a FIFO cannot block the open) and
  ``O_CLOEXEC``; then ``fstat`` must say *regular file*. Sizes come from that ``fstat``: a
  chunk claiming bytes its file does not hold is refused before any buffer is allocated.
  And the size must be backed by the disk: a *sparse* file (``truncate -s 8G``: 8 GiB of
  size in 4 KiB of blocks) is refused when opened (:func:`check_backed`), so that what a
  reader allocates is bounded by what the root actually stores, not by what its sizes say.
- Writing: ``O_NOFOLLOW | O_CLOEXEC`` on every open, refused unless the result is a regular
  file; the mode is set exactly (0600 by default, :data:`DEFAULT_MODE`), directories
  created with the matching 0700; a rename is followed by an ``fsync`` of its directory, so
  that a commit survives a power loss once it returned.

Everything raises ``CorruptCheckpoint`` (reads) or ``CheckpointError`` (writes) naming the
path and the fix. Remote fsspec backends have no links or FIFOs; ``durable.py`` checks their
sizes through fsspec instead.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from peerckpt.errors import CheckpointError, CorruptCheckpoint

DEFAULT_MODE = 0o600  # durable files: readable and writable by their owner only
# A file's size may exceed the bytes its disk holds for it (st_blocks, then its data extents)
# by this factor, plus one block, before it is refused as sparse. peerckpt writes every byte
# of its files, so on most file systems they hold their whole size; the factor leaves room
# for file systems that compress (ZFS, btrfs) or store zero blocks as holes (ZFS with
# compression), and the block for data kept inside the inode (ext4, btrfs inline files).
SPARSE_FACTOR = 16
SPARSE_SLACK = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def check_mode(mode: int) -> int:
    """``mode`` if it is a valid mode for durable files: read-write for the owner, no
    execute, set-id or sticky bits (ValueError otherwise)."""
    if not isinstance(mode, int) or mode & ~0o666 or mode & 0o600 != 0o600:
        raise ValueError(
            f"durable file mode {mode!r} must give its owner read and write and nobody execute "
            "(0600, 0640, 0644, ...)"
        )
    return mode


def dir_mode(mode: int) -> int:
    """The mode of directories holding files of ``mode``: search wherever there is read."""
    return mode | (mode & 0o444) >> 2


# -- reading ---------------------------------------------------------------------------------
@contextlib.contextmanager
def open_regular(directory: str, name: str, follow_dir: bool = False) -> Iterator[tuple[int, int]]:
    """Open ``directory/name`` for reading; yield (fd, size). FileNotFoundError if it is
    missing; CorruptCheckpoint if it, or ``directory`` (unless ``follow_dir``), is a link,
    or it is anything but a regular file."""
    path = os.path.join(directory, name)
    try:
        dfd = os.open(directory, _DIR_FLAGS | (0 if follow_dir else os.O_NOFOLLOW))
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CorruptCheckpoint(
                f"{directory} is not a directory but a link or another kind of file; peerckpt "
                "reads only real directories and regular files inside the checkpoint root"
            ) from None
        raise
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise _not_regular(
                path, "a link" if exc.errno == errno.ELOOP else exc.strerror
            ) from None
        raise
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, _kind(st.st_mode))
        check_backed(path, fd, st)
        yield fd, st.st_size
    finally:
        os.close(fd)


def check_backed(path: str, fd: int, st: os.stat_result) -> None:
    """CorruptCheckpoint if the open regular file ``fd`` is sparse: its size more than
    :data:`SPARSE_FACTOR` times (plus :data:`SPARSE_SLACK`) the data its disk holds for it.

    A sparse file costs its maker nothing (``truncate -s 8G``) and reads back as zeros, so a
    manifest sized to it would make a reader allocate gigabytes from a root of kilobytes. The
    allocated blocks (``st_blocks``) answer at once for every file peerckpt writes; only a
    file that looks sparse by them has its data extents counted (``SEEK_DATA``/``SEEK_HOLE``,
    which a file system that reports blocks late, as ZFS does for a file just written, answers
    exactly), stopping as soon as enough data is found."""
    need = (st.st_size - SPARSE_SLACK + SPARSE_FACTOR - 1) // SPARSE_FACTOR  # data to accept
    if need <= 0 or st.st_blocks * 512 >= need:
        return
    held = _data_bytes(fd, st.st_size, need)
    if held < need:
        raise CorruptCheckpoint(
            f"{path} is a sparse file: its size is {st.st_size} bytes, but its disk holds only "
            f"{held} bytes of data for it; peerckpt never writes sparse files, and reading it "
            "would allocate memory for bytes the checkpoint does not store (someone who can "
            "write to the root made it, or a copy kept its holes). Restore the file from an "
            "intact copy; a file system that stores zeros as holes (ZFS with compression) may "
            "hold a step of mostly-zero tensors this way: copy the root to storage that does not"
        )


def _data_bytes(fd: int, size: int, enough: int) -> int:
    """The bytes of ``fd``'s first ``size`` that lie in data extents, not holes, counted
    until ``enough`` are found; every byte where the file system cannot tell."""
    held, at = 0, 0
    try:
        while at < size and held < enough:
            start = os.lseek(fd, at, os.SEEK_DATA)
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            held += end - start
            at = end
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no data past ``at``: the rest is a hole
            return held
        return size  # SEEK_DATA unsupported: the blocks may be counted late, so trust the size
    return held


def _not_regular(path: str, what: str | None) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"{path} is not a regular file ({what}); peerckpt neither follows links nor reads "
        "devices or FIFOs in a checkpoint root: remove it, and check who can write there"
    )


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a file"


def read_whole(directory: str, name: str, limit: int, follow_dir: bool = False) -> bytes:
    """All of regular file ``directory/name`` (as much as its size says, no more);
    CorruptCheckpoint, before anything is read, if it is larger than ``limit`` bytes."""
    with open_regular(directory, name, follow_dir) as (fd, size):
        check_small(os.path.join(directory, name), size, limit)
        return _pread(fd, size, 0)


def check_small(path: str, size: int, limit: int) -> None:
    """CorruptCheckpoint unless a metadata file of ``size`` bytes is within ``limit``."""
    if size > limit:
        raise CorruptCheckpoint(
            f"{path} is {size} bytes, more than the {limit} a file of its kind can be; it is "
            "not a file peerckpt wrote, and it is not read"
        )


def read_range(directory: str, name: str, start: int, n: int, what: str) -> bytes:
    """Bytes ``start:start+n`` of regular file ``directory/name``; CorruptCheckpoint naming
    ``what`` if the file does not hold them (checked before anything is allocated)."""
    with open_regular(directory, name) as (fd, size):
        check_extent(os.path.join(directory, name), size, start, n, what)
        return _pread(fd, n, start)


def file_size(directory: str, name: str) -> int:
    """The size of regular file ``directory/name``."""
    with open_regular(directory, name) as (_, size):
        return size


def check_extent(path: str, size: int, start: int, n: int, what: str) -> None:
    """CorruptCheckpoint unless a file of ``size`` bytes holds ``start:start+n``."""
    if start + n > size:
        raise CorruptCheckpoint(
            f"{path} holds only {size} bytes, but {what} claims bytes {start}–{start + n}; "
            "the checkpoint is damaged"
        )


def _pread(fd: int, n: int, start: int) -> bytes:
    parts, got = [], 0
    while got < n:
        data = os.pread(fd, n - got, start + got)
        if not data:
            break  # the file shrank meanwhile: the caller's length check says so
        parts.append(data)
        got += len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


# -- writing ---------------------------------------------------------------------------------
def open_for_write(path: str, mode: int, extra: int = 0) -> int:
    """Create or truncate regular file ``path`` for writing, with exactly ``mode``; return
    the descriptor. CheckpointError if ``path`` is a link or not a regular file."""
    try:
        fd = os.open(path, _WRITE_FLAGS | extra, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise _unwritable(
                path, "a symbolic link" if exc.errno == errno.ELOOP else None
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _unwritable(path, _kind(st.st_mode))
        os.fchmod(fd, mode)
        os.set_blocking(fd, True)  # O_NONBLOCK was only there so that a FIFO could not block
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unwritable(path: str, what: str | None) -> CheckpointError:
    return CheckpointError(
        f"{path} is {what or 'not a regular file'}; peerckpt never writes through links or into "
        f"devices or FIFOs (another user may have planted it): remove it, and check who can "
        f"write to {os.path.dirname(path)}"
    )


def make_dirs(path: str, mode: int, leaf_may_be_link: bool) -> None:
    """Create directory ``path`` and its missing parents with ``dir_mode(mode)``, each made
    durable in its parent. An existing ``path`` is kept as it is, unless it is a link and
    ``leaf_may_be_link`` is False (a step directory), which is a CheckpointError."""
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
            os.mkdir(directory, dir_mode(mode))
            fd = os.open(directory, _DIR_FLAGS | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, dir_mode(mode))  # exactly: the umask may have taken bits
            finally:
                os.close(fd)
        fsync_dir(os.path.dirname(directory))
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and leaf_may_be_link:
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(
            f"{path} is not a directory (a link or another kind of file); remove it, and check "
            "who can write to the checkpoint root"
        )


def replace(tmp: str, path: str) -> None:
    """Rename ``tmp`` to ``path`` and make the rename durable (fsync of the directory)."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    """fsync directory ``path``: its entries (a file created or renamed) survive a crash."""
    fd = os.open(path or ".", _DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
