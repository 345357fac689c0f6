"""The agent's durable writer: straight from the slots, and a copy first once that lost."""

from __future__ import annotations

import threading

from peerckpt.messages.control import Flush, Flushed
from peerckpt.persist.config import PersistConfig
from peerckpt.persist.durable import DurableStore
from peerckpt.replication.replicator import ReplicationJob
from peerckpt.replication.writer import Flusher

from .conftest import write_snapshot


def _flush(flusher: Flusher, reports: list[Flushed], slot, url: str, rate: float | None = None):
    config = PersistConfig(url, every=1, rate=rate)
    flusher.start(
        Flush(
            slot.manifest.step,
            0,
            0,
            config.to_msg(),
            [(slot.rank, c.to_msg()) for c in slot.manifest.chunks],
        )
    )
    flusher.join(30)
    return reports[-1]


def test_a_slot_rewritten_mid_flush_fails_that_flush_and_later_ones_copy_first(
    peers, tmp_path
) -> None:
    store = peers[0].store
    reports: list[Flushed] = []
    flusher = Flusher(store, 0, reports.append)
    url = f"file://{tmp_path}/ckpt"

    slot = write_snapshot(store, rank=0, step=4)
    # Throttled to 2 MB/s, the flush is still writing when the rank reuses the slot.
    rewrite = threading.Timer(0.5, lambda: ReplicationJob.start(0, slot, slot.manifest, buddies=[]))
    rewrite.start()
    first = _flush(flusher, reports, slot, url, rate=2e6)
    rewrite.join()
    assert first.ok is False and "was reused for a newer snapshot" in first.error
    assert flusher._copy_first  # the disk is slower than the steps: copy the share first

    slot = write_snapshot(store, rank=0, step=5)
    second = _flush(flusher, reports, slot, url)
    assert second.ok is True and second.nbytes == slot.manifest.used_bytes
    durable = DurableStore(url)
    durable.commit(5, epoch=0, layouts={0: list(slot.manifest.chunks)})
    ckpt = durable.open(5)
    assert ckpt.verify() == []
    image, _ = ckpt.slot_image(0)
    used = slot.manifest.used_bytes
    assert bytes(image[: used - 100]) == bytes(slot.segment.view[: used - 100])
