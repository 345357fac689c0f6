"""What of the launching shell's environment reaches the processes of a ``--ray`` job.

Locally and on several hosts every process of a job inherits its launcher's environment,
as under srun or torchrun. On a Ray cluster a host's processes descend from its actor's Ray
worker, whose environment is its node's (the raylet's), so the driver sends its own along:
``forwarded(os.environ)`` goes with the actor's orders and is laid over the node's
environment (``rayactor.RayHost.start``), and ``--env KEY=VALUE`` (``JobSpec.env``) is laid
over both, on every host alike. A variable set in the shell that runs ``peerckpt run --ray``
(``NCCL_DEBUG``, ``HF_TOKEN``, ``WANDB_PROJECT``, ``PYTHONPATH``, ``OMP_NUM_THREADS``…) is
seen by every rank, as srun does by default.

Not forwarded: what describes the launching machine rather than the job, where the node's own
value (or none) is the right one; ``--env`` sets any of them for every node:

- the machine and the login session: ``HOSTNAME``, ``HOST``, ``PWD``/``OLDPWD`` (the ranks
  start in the launching directory anyway, ``PEERCKPT_RAY_CWD``), ``SHLVL``, ``_``, ``SSH_*``,
  ``DISPLAY``, ``XAUTHORITY``, ``WAYLAND_DISPLAY``, ``XDG_*``, ``DBUS_SESSION_BUS_ADDRESS``,
  ``TMUX``/``TMUX_PANE``/``STY``/``TERM_SESSION_ID``, ``KRB5CCNAME``;
- the user the node runs the job as: ``HOME``, ``USER``, ``LOGNAME``, ``SHELL``, ``MAIL``
  (a Ray node often runs as another user, with another home: caches written under a home of
  the launching machine would fail);
- the machine's scratch space: ``TMPDIR``, ``TMP``, ``TEMP`` (a path that may not exist on a
  node, and a node's local disk is the one to use);
- the machine's devices: ``CUDA_VISIBLE_DEVICES`` and every ``*_VISIBLE_DEVICES``,
  ``ONEAPI_DEVICE_SELECTOR`` (which GPUs a node's ranks see is that node's, as Ray sets it);
- the Python installation: ``PATH``, ``LD_LIBRARY_PATH``, ``PYTHONHOME``, ``VIRTUAL_ENV``,
  ``CONDA_*`` (the ranks run the node's interpreter, the one Ray runs there; the launching
  machine's paths would mix two installations);
- Ray's own settings, ``RAY_*`` (the node's raylet has its own; the job's processes never talk
  to Ray), and peerckpt's per-process and per-machine ones: the secret (it travels as the
  actor's argument), ``PEERCKPT_SECRET_FILE`` and ``PEERCKPT_NODE_ADDR`` (a path and an
  address of this machine), ``PEERCKPT_RAY_*`` and the variables every launcher sets for each
  process it starts (``checks.RESERVED_ENV``).

This module is pure: it reads the map it is given and never imports Ray.
"""

from __future__ import annotations

from collections.abc import Mapping

from peerckpt.launch.checks import RESERVED_ENV

NOT_FORWARDED = frozenset(
    {
        # the machine and the login session
        "HOSTNAME",
        "HOST",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
        "DISPLAY",
        "XAUTHORITY",
        "WAYLAND_DISPLAY",
        "DBUS_SESSION_BUS_ADDRESS",
        "TMUX",
        "TMUX_PANE",
        "STY",
        "TERM_SESSION_ID",
        "KRB5CCNAME",
        # the user
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "MAIL",
        # scratch space
        "TMPDIR",
        "TMP",
        "TEMP",
        # devices
        "ONEAPI_DEVICE_SELECTOR",
        # the Python installation
        "PATH",
        "LD_LIBRARY_PATH",
        "PYTHONHOME",
        "VIRTUAL_ENV",
        # peerckpt's, of this machine or of one process
        "PEERCKPT_SECRET_FILE",
        "PEERCKPT_NODE_ADDR",
        *RESERVED_ENV,
    }
)
NOT_FORWARDED_PREFIXES = ("SSH_", "XDG_", "CONDA_", "RAY_", "PEERCKPT_RAY_")
NOT_FORWARDED_SUFFIXES = ("_VISIBLE_DEVICES",)


def is_forwarded(name: str) -> bool:
    """Whether the driver's variable ``name`` reaches the job's processes on Ray nodes."""
    return not (
        name in NOT_FORWARDED
        or name.startswith(NOT_FORWARDED_PREFIXES)
        or name.endswith(NOT_FORWARDED_SUFFIXES)
    )


def forwarded(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` (the launching shell's) that the driver sends to every host."""
    return {name: value for name, value in environ.items() if is_forwarded(name)}
