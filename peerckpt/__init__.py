"""peerckpt: peer-replicated, in-memory checkpointing for PyTorch training.

Every rank keeps its training state in host memory and mirrors it to buddies on other nodes;
when a rank or a node dies, the job restores the last committed step from the memory of
healthy peers and goes on, bit for bit as if nothing had happened.

The public API fits on one screen::

    @peerckpt.resilient()
    def train(ctx: peerckpt.Context) -> None: ...

plus ``peerckpt.Shard`` / ``peerckpt.FlatShard`` (hand-sharded tensors), the data-loader
protocol ``peerckpt.Reshardable`` and ``peerckpt.ResumableSampler`` which implements it,

and the launcher: ``peerckpt run --nodes N --nproc-per-node P [--spares S] script.py``.

Layer: ground. The modules directly in this folder are the vocabulary no process owns
(errors, chunk and manifest types, box math, dtypes, the codec and typed messages, wire
framing, RPC plumbing, shared-memory names, named states, the fault-hook interface). They
may import nothing of peerckpt above them. This ``__init__`` is the public API: its names
above are loaded lazily from the rank's package when a training script asks for them, so
that agents and the coordinator never import torch. The launchers and the command line live
in their own folder, ``launch/`` (``peerckpt.launch``). docs/architecture.md draws the layers;
``tests/test_layers.py`` keeps them.
"""

import os as _os
from collections.abc import Mapping as _Mapping

from peerckpt.errors import (
    AuthenticationError,
    CheckpointError,
    ChecksumMismatch,
    CommitTimeout,
    ConfigurationError,
    CorruptCheckpoint,
    FrameTooLarge,
    InsufficientMemory,
    MembershipChanged,
    NoCheckpoint,
    PeerckptError,
    PeerUnavailable,
    RecoveryFailed,
    StaleEpoch,
    StateMismatch,
)

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "CheckpointError",
    "ChecksumMismatch",
    "CommitTimeout",
    "ConfigurationError",
    "Context",
    "CorruptCheckpoint",
    "FlatShard",
    "FrameTooLarge",
    "InsufficientMemory",
    "MembershipChanged",
    "NoCheckpoint",
    "PeerUnavailable",
    "PeerckptError",
    "RecoveryFailed",
    "Reshardable",
    "ResumableSampler",
    "Shard",
    "StaleEpoch",
    "StateMismatch",
    "resilient",
]


_LAZY = {
    "resilient": "peerckpt.runtime.api",
    "Context": "peerckpt.runtime.api",
    "Shard": "peerckpt.runtime.layouts",
    "FlatShard": "peerckpt.runtime.layouts",
    "ResumableSampler": "peerckpt.runtime.sampler",
    "Reshardable": "peerckpt.runtime.sampler",
}


def __getattr__(name: str) -> object:
    # The runtime imports torch; load it only when a training script asks for it, so the
    # launcher, agents and coordinator start fast and small.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'peerckpt' has no attribute {name!r}")


def _in_a_jobs_training_process(env: _Mapping[str, str]) -> bool:
    """Whether this process is a training process of a peerckpt job: started by a launcher
    (``PEERCKPT_ROLE``), or a torchrun worker of a job (torchrun's run id and the job's
    secret, which the agents and supervisors never have in their environment)."""
    if "PEERCKPT_ROLE" in env:
        return True
    secret = "PEERCKPT_SECRET" in env or "PEERCKPT_SECRET_FILE" in env
    return "TORCHELASTIC_RUN_ID" in env and secret


if _in_a_jobs_training_process(_os.environ):
    # A script's own dist.init_process_group() at its top level (nanoGPT's train.py) does
    # nothing from here on, and a spare waits here for the rank it takes, so that the script's
    # top level reads that rank's RANK, LOCAL_RANK and WORLD_SIZE (runtime/standby.py).
    import importlib as _importlib

    _importlib.import_module("peerckpt.runtime.standby").on_import()
