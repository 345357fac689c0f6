"""The coordinator's follow-up of redundancy-aware replication (``recovery/twins.py``).

After each ``Replicated`` report: a step whose verification found ranks short (their
data-parallel chunks differ from their twins', or too few twins hold them) gets one clear
warning per rank and epoch and a ``ReplicateWhole`` to the rank's node; the first commit of
an epoch logs how many bytes per step the job did not mirror because twins hold them.

It sends events through the registry; it never decides a commit (the ``CommitTracker`` does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from peerckpt.messages.control import Replicated, ReplicateWhole
from peerckpt.recovery.commits import CommitTracker
from peerckpt.units import human

log = logging.getLogger("peerckpt.coordinator")


class DedupWatch:
    """Sends ``ReplicateWhole`` for ranks found short, and logs what deduplication saves."""

    def __init__(self, send: Callable[[int, Any], None]) -> None:
        self._send = send  # (node, event)
        self._warned: set[tuple[int, int]] = set()  # (epoch, rank)
        self._asked: set[tuple[int, int, int]] = set()  # (epoch, rank, step)
        self._logged: set[int] = set()  # epochs whose savings were logged
        self._saved: dict[int, tuple[int, int]] = {}  # rank → (bytes left out, snapshot bytes)

    def reported(self, msg: Replicated, tracker: CommitTracker, committed: int | None) -> None:
        """Follow up ``msg`` once ``tracker`` recorded it (``committed``: what it committed)."""
        self._saved[msg.rank] = (msg.deduplicated, msg.nbytes)
        for rank, step in tracker.short:
            node = tracker.domains.get(rank, (msg.node, 0))[0]
            if (tracker.epoch, rank) not in self._warned:
                self._warned.add((tracker.epoch, rank))
                log.warning(
                    "rank %d's data-parallel state at step %d is not held by enough twins "
                    "(its checksums differ from the other ranks', or too few nodes hold "
                    "them): replicating rank %d whole for the rest of epoch %d",
                    rank,
                    step,
                    rank,
                    tracker.epoch,
                )
            if (tracker.epoch, rank, step) not in self._asked:
                self._asked.add((tracker.epoch, rank, step))
                self._send(node, ReplicateWhole(tracker.epoch, rank, step))
        if committed is not None and tracker.epoch not in self._logged:
            self._logged.add(tracker.epoch)
            saved = sum(s for r, (s, _) in self._saved.items() if r in tracker.ranks)
            total = sum(n for r, (_, n) in self._saved.items() if r in tracker.ranks)
            if saved:
                log.info(
                    "redundancy-aware replication: %s of %s per snapshot step not %s "
                    "(%d of %d bytes: data-parallel twins hold them; resilient(dedup=False) "
                    "turns it off)",
                    human(saved),
                    human(total),
                    "mirrored" if tracker.coding is None else "coded into parity",
                    saved,
                    total,
                )
