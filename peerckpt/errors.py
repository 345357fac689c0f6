"""Exception classes of peerckpt.

Every error names its cause and, where there is one, the fix. They live here, in the public
package, because users catch them and every subpackage raises them.
"""

from __future__ import annotations


class PeerckptError(Exception):
    """Base class of every error peerckpt raises on purpose."""


class ConfigurationError(PeerckptError):
    """The job was started with settings that cannot work (missing environment, bad flags)."""


class NotReshardable(ConfigurationError):
    """The job tracks state that cannot follow a change of world size (a data loader without
    ``load_resharded_state``), so a shrink or grow is refused before it happens: an elastic
    start (``--min-nodes``) or a node that joins. The message names the objects and the fix,
    ``FIX``, said the same by the ranks and the coordinator."""

    FIX = (
        "draw batches with peerckpt.ResumableSampler (sampler.take(batch) in the step, tracked "
        "as ctx.track(..., sampler=sampler)), which hands out every sample of a data epoch "
        "exactly once across a change of world size (docs/resharding.md)"
    )


class AuthenticationError(PeerckptError):
    """A connection did not prove knowledge of the job's secret, or was refused for that."""


class ProtocolError(PeerckptError):
    """A peer sent bytes that do not follow the wire protocol."""


class FrameTooLarge(ProtocolError):
    """A frame declared more bytes than its destination can hold; nothing of it was read."""


class ChecksumMismatch(PeerckptError):
    """Bytes of a snapshot or replica do not match the checksum recorded when they were taken."""


class StaleEpoch(PeerckptError):
    """A message carried an epoch older than the current one and was fenced off."""


class PeerUnavailable(PeerckptError):
    """A peer agent could not be reached or stopped answering."""


def no_answer(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer did not answer (refused, reset, closed) rather than what
    it sent was wrong: its node may be dying (``RecoveryFailed.unreachable``)."""
    return isinstance(exc, (PeerUnavailable, OSError))


class InsufficientMemory(PeerckptError):
    """Host memory (or /dev/shm) is too small for the snapshot slots that were asked for."""


class StateMismatch(PeerckptError):
    """The state being restored does not fit the objects passed to ``ctx.track``."""


class RecoveryFailed(PeerckptError):
    """No surviving copy of some state could be found; the job cannot continue from memory.

    ``unreachable``: some source could not be reached at all, rather than holding no valid
    copy; its node may be dying, its loss not yet declared (the coordinator then waits for
    that loss before failing the job)."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class CommitTimeout(PeerckptError):
    """A snapshot was never committed: replication is stuck, and the job cannot go on safely."""


class CheckpointError(PeerckptError):
    """A durable checkpoint could not be written, found or read."""


class NoCheckpoint(CheckpointError):
    """No committed durable checkpoint exists where one was asked for."""


class StorageUnusable(CheckpointError, ConfigurationError):
    """A durable storage URL cannot work: its scheme is unknown, the fsspec package that
    serves it is not installed, or nothing can be written there. Raised before a job depends
    on it (``persist/location.py``), naming the URL and the fix."""


class CorruptCheckpoint(CheckpointError):
    """Bytes of a durable checkpoint do not match their recorded checksum, or it is malformed."""


class MalformedManifest(CorruptCheckpoint, ProtocolError):
    """A manifest or chunk record (read from storage or received from a peer) passed its
    checksum but has a field of the wrong type or out of range; nothing of it was used."""


class MembershipChanged(PeerckptError):
    """Raised inside a rank when the job's membership changed; the runtime restarts the function.

    User code should let it propagate. The runtime catches it, rejoins the new epoch, restores
    the last committed step and calls the decorated function again.
    """


class JobEnded(PeerckptError):
    """A process came to a job that has already ended (a worker torchrun restarted after the
    job failed): it must not start training alone; the message says how the job ended."""
