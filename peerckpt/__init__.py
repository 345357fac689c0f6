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
