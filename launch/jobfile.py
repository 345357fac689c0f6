"""Where a running job is found on this machine: its claim on its name, and its job file.

``peerckpt run`` claims the job's name for as long as it runs and publishes what
``peerckpt join`` needs (the coordinator's address, the job's secret, the script, its
``--env``, the run id); ``peerckpt join --job NAME`` reads it back. Both live in one
directory per user::

    $TMPDIR/peerckpt-<uid>/            0700, owned by the user
    $TMPDIR/peerckpt-<uid>/NAME.lock   0600: flock-ed by the launcher while it runs, its pid
    $TMPDIR/peerckpt-<uid>/NAME.json   0600: the job file

The temp directory is shared with every user of the host, so everything read there is
checked before it is trusted: the name (``peerckpt/names.py``) before it becomes a path, the
directory and the files for owner, mode and kind (opened without following links), and the
job file's fields for type. The job file holds the job's secret and names a script that
``join`` runs: a file planted by another user must never be taken for it. The claim is an
advisory ``flock``, so a launcher killed with SIGKILL releases it with its last descriptor,
and the next ``peerckpt run`` of that name takes over its stale files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import tempfile
from typing import Any

from peerckpt.errors import ConfigurationError
from peerckpt.names import check_job_name, check_run_id
from peerckpt.secret import check_secret

_MAX_JOB_FILE = 64 << 10
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def user_dir(create: bool = False) -> str:
    """This user's directory of job files; ConfigurationError unless it is a real directory
    owned by this user with mode 0700 (``create``: make it if it is missing)."""
    uid = os.getuid()
    path = os.path.join(tempfile.gettempdir(), f"peerckpt-{uid}")
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    st = os.lstat(path)
    problem = ""
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory (a link or a file)"
    elif st.st_uid != uid:
        problem = f"is owned by uid {st.st_uid}, not by you (uid {uid})"
    elif stat.S_IMODE(st.st_mode) != 0o700:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    if problem:
        raise ConfigurationError(
            f"{path} {problem}: peerckpt keeps job files (with the job's secret) only in a "
            "private directory of your own. Another user may have made it: remove it, or set "
            "TMPDIR to a directory only you can write to"
        )
    return path


def _check_private(path: str, fd: int) -> None:
    st = os.fstat(fd)
    uid = os.getuid()
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o600:
        raise ConfigurationError(
            f"{path} is not a private file of yours (kind {stat.S_IFMT(st.st_mode):o}, owner "
            f"uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}; it must be a regular file of "
            f"uid {uid} with mode 0600); it is not used. Remove it and start the job again"
        )


class JobClaim:
    """A running launcher's hold on its job name, and the job file it publishes.

    ``JobClaim(job)`` takes the name (ConfigurationError if a live launcher holds it),
    ``publish(info)`` writes the job file once the job is up, ``release()`` gives both up.
    """

    def __init__(self, job: str) -> None:
        self.job = check_job_name(job)
        directory = user_dir(create=True)
        self.lock_path = os.path.join(directory, f"{job}.lock")
        self.file_path = os.path.join(directory, f"{job}.json")
        self._fd: int | None = self._take()

    def _take(self) -> int:
        for _ in range(3):  # the holder may remove the file between our open and our lock
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | _OPEN, 0o600)
            try:
                _check_private(self.lock_path, fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    raise ConfigurationError(
                        f"job {self.job} is already running (pid {pid}); choose another --job"
                    ) from None
                if os.fstat(fd).st_ino != _inode(self.lock_path):
                    os.close(fd)  # locked a file its holder removed meanwhile: try again
                    continue
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
        raise ConfigurationError(f"could not claim job name {self.job}; try again")

    def publish(self, info: dict[str, Any]) -> None:
        """Write the job file (0600, replacing a stale one atomically)."""
        tmp = f"{self.file_path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({**info, "job": self.job, "pid": os.getpid()}, f)
        os.replace(tmp, self.file_path)

    def release(self) -> None:
        """Remove the job file and the claim. Idempotent."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.file_path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock_path)  # while still locked: a new claimant makes a new file
        os.close(self._fd)
        self._fd = None


def _inode(path: str) -> int:
    try:
        return os.lstat(path).st_ino
    except FileNotFoundError:
        return -1


def find_job(job: str) -> dict[str, Any]:
    """The job file of the running job ``job`` of this user on this machine, checked.

    ConfigurationError naming the problem: a bad name, no such job, a job whose launcher is
    gone, or a directory or file that is not private to this user (then nothing is read).
    """
    check_job_name(job)
    missing = ConfigurationError(
        f"no running job named {job!r} on this machine; start it with "
        f"`peerckpt run --job {job} …` (or give the name it printed)"
    )
    try:
        directory = user_dir()
    except FileNotFoundError:
        raise missing from None
    path = os.path.join(directory, f"{job}.json")
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN)
    except FileNotFoundError:
        raise missing from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise ConfigurationError(
                f"{path} is a link or not a file; it is not used. Remove it and start the job again"
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        _check_private(path, fd)
        raw = f.read(_MAX_JOB_FILE + 1)
    if not _is_claimed(os.path.join(directory, f"{job}.lock")):
        raise ConfigurationError(
            f"job {job} is not running any more (its launcher exited without removing "
            f"{path}); start it again with `peerckpt run --job {job} …`"
        )
    return _parse(raw, path)


def _is_claimed(lock_path: str) -> bool:
    """Whether a live launcher holds the claim at ``lock_path``."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | _OPEN)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _parse(raw: bytes, path: str) -> dict[str, Any]:
    """The job file's fields, each of the type ``join`` needs (ConfigurationError if not)."""
    try:
        if len(raw) > _MAX_JOB_FILE:
            raise ValueError(f"it is larger than {_MAX_JOB_FILE} bytes")
        info = json.loads(raw)
        if not isinstance(info, dict):
            raise ValueError("it is not a JSON object")
        script = info.get("script")
        if not (isinstance(script, list) and script and all(isinstance(a, str) for a in script)):
            raise ValueError("script is not a list of strings")
        if not isinstance(info.get("coordinator"), str):
            raise ValueError("coordinator is not a string")
        nproc = info.get("nproc_per_node")
        if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
            raise ValueError("nproc_per_node is not a positive integer")
        env = info.setdefault("env", {})  # the job's --env, for its joiners too
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ValueError("env is not a map of strings to strings")
        check_run_id(info.get("run"))  # type: ignore[arg-type]
        check_secret(bytes.fromhex(info.get("secret")), "the job file's secret")  # type: ignore[arg-type]
    except (ValueError, TypeError, ConfigurationError) as exc:
        raise ConfigurationError(
            f"{path} is not a valid job file ({exc}); remove it and start the job again"
        ) from None
    return info
