"""peerckpt: peer-replicated, in-memory checkpointing for PyTorch training.

Every rank keeps its training state in host memory and mirrors it to buddies on other nodes;
when a rank or a node dies, the job restores the last committed step from the memory of
healthy peers and goes on, bit for bit as if nothing had happened.

The public API fits on one screen::

    @peerckpt.resilient()
    def train(ctx: peerckpt.Context) -> None: ...

and the launcher: ``peerckpt run --nodes N --nproc-per-node P [--spares S] script.py``.
"""

from peerckpt.errors import (
    AuthenticationError,
    ChecksumMismatch,
    CommitTimeout,
    ConfigurationError,
    FrameTooLarge,
    InsufficientMemory,
    MembershipChanged,
    PeerckptError,
    PeerUnavailable,
    RecoveryFailed,
    StaleEpoch,
    StateMismatch,
)

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "ChecksumMismatch",
    "CommitTimeout",
    "ConfigurationError",
    "Context",
    "FrameTooLarge",
    "InsufficientMemory",
    "MembershipChanged",
    "PeerUnavailable",
    "PeerckptError",
    "RecoveryFailed",
    "StaleEpoch",
    "StateMismatch",
    "resilient",
]


def __getattr__(name: str) -> object:
    # The runtime imports torch; load it only when a training script asks for it, so the
    # launcher, agents and coordinator start fast and small.
    if name in ("resilient", "Context"):
        from peerckpt.runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'peerckpt' has no attribute {name!r}")
