"""Names a job is known by on a host, checked before they reach a file name or a pattern.

A *job name* (``--job``) is the user's handle: ``peerckpt join --job NAME`` finds the job by
it, and it prefixes the job's shared-memory segments. It comes from a command line, so it is
checked here — 1-40 characters of ``a-z``, ``0-9`` and ``_`` — before it is joined to any
path or glob: no separator, no wildcard, no ``-`` (which separates the parts of a segment's
name, so that job ``exp`` never matches the files of a job ``exp-2``).

A *run id* is random, made once per ``peerckpt run`` and handed to every process of that run
in ``PEERCKPT_RUN`` (the environment, like the secret: not on a command line that ``ps``
shows). It is part of every segment's name, so two runs of one job name never share or
remove each other's segments.

Pure functions; no I/O.
"""

from __future__ import annotations

import re
import secrets

from peerckpt.errors import ConfigurationError

RUN_ENV = "PEERCKPT_RUN"
_JOB_NAME = re.compile(r"[a-z0-9][a-z0-9_]{0,39}")
_RUN_ID = re.compile(r"[0-9a-f]{16}")


def check_job_name(job: str) -> str:
    """``job`` if it is a valid job name; ConfigurationError naming the rule otherwise."""
    if not isinstance(job, str) or not _JOB_NAME.fullmatch(job):
        raise ConfigurationError(
            f"job name {job!r:.60} must be 1-40 characters of a-z, 0-9 and '_' (starting with a "
            "letter or digit); choose another --job"
        )
    return job


def new_run_id() -> str:
    """A fresh random run id (64 bits: no two runs on a host pick the same)."""
    return secrets.token_hex(8)


def check_run_id(run: str) -> str:
    """``run`` if it is a run id as :func:`new_run_id` makes; ConfigurationError otherwise."""
    if not isinstance(run, str) or not _RUN_ID.fullmatch(run):
        raise ConfigurationError(
            f"run id {run!r:.40} is not 16 hex digits; {RUN_ENV} is set by `peerckpt run` for "
            "the processes it starts"
        )
    return run
