"""Whether this process's training thread waits inside peerckpt itself.

A snapshot's copy still in flight when the next ``optimizer.step()`` comes, a commit the
calibration waits for, a request to the node agent: the training thread waits there using no
CPU and in no collective. Its heartbeats say so (``Beat.waiting``), so that the agent's stall
watch (``replication/stall.py``) never takes such a wait (replication's backpressure) for a
rank stuck in the script's own code.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_count = 0  # waits under way, any thread


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """A wait of the runtime's own, for as long as the block runs."""
    global _count
    with _lock:
        _count += 1
    try:
        yield
    finally:
        with _lock:
            _count -= 1


def now() -> bool:
    """Whether some thread of this process waits inside the runtime now."""
    return _count > 0
