"""The coordinator's event hub: broadcasts logged once, per-node sends, order, end, trimming."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from peerckpt.codec import unpack
from peerckpt.messages import decode
from peerckpt.messages.control import Commit, Event, Shutdown
from peerckpt.recovery import mailboxes
from peerckpt.recovery.mailboxes import EventHub, Mailbox
from peerckpt.states import JobState


def _drain(box: Mailbox) -> list[Event | None]:
    out = []
    while not box.empty():
        out.append(box.get())
    return out


def test_a_node_sees_broadcasts_and_its_own_events_in_the_order_they_were_published() -> None:
    hub = EventHub()
    a, b = hub.mailbox(), hub.mailbox()
    hub.broadcast(Commit(0, 1))
    a.put(Commit(9, 9))
    hub.broadcast(Commit(0, 2))
    assert _drain(a) == [Commit(0, 1), Commit(9, 9), Commit(0, 2)]
    assert _drain(b) == [Commit(0, 1), Commit(0, 2)]
    late = hub.mailbox()  # registered later: only what comes after
    hub.broadcast(Commit(0, 3))
    assert _drain(late) == [Commit(0, 3)] and _drain(b) == [Commit(0, 3)]
    with pytest.raises(queue.Empty):
        late.get()


def test_an_ended_mailbox_gets_what_came_before_its_end_and_nothing_after() -> None:
    hub = EventHub()
    box, detached = hub.mailbox(), hub.mailbox()
    hub.broadcast(Commit(0, 1))
    box.put(None)
    detached.detach()
    hub.broadcast(Commit(0, 2))
    box.put(Commit(0, 3))
    assert _drain(box) == [Commit(0, 1), None]
    assert _drain(detached) == [Commit(0, 1)]


def test_the_log_is_trimmed_once_every_reader_has_read_it() -> None:
    hub = EventHub()
    box = hub.mailbox()
    n = 3 * mailboxes.TRIM_MIN
    for step in range(n):
        hub.broadcast(Commit(0, step))
        assert box.get() == Commit(0, step)
    assert len(hub._log) <= mailboxes.TRIM_MIN + 1  # not n: read entries are dropped
    slow = hub.mailbox()
    for step in range(n):
        hub.broadcast(Commit(1, step))
    assert [slow.get() for _ in range(n)] == [Commit(1, s) for s in range(n)]  # kept for it


def test_a_stream_wakes_for_events_published_on_another_thread_and_ends_with_the_mailbox() -> None:
    hub = EventHub()
    box = hub.mailbox()

    def publish() -> None:
        for step in range(50):
            hub.broadcast(Commit(0, step))
        box.put(Shutdown(JobState.SUCCEEDED))
        box.put(None)

    async def read() -> list[Event]:
        got = []
        asyncio.get_running_loop().call_later(0.05, threading.Thread(target=publish).start)
        async for data in box.stream(limit=7):
            got.append(decode(unpack(data), Event))
        return got

    got = asyncio.run(asyncio.wait_for(read(), timeout=10.0))
    assert got == [*(Commit(0, s) for s in range(50)), Shutdown(JobState.SUCCEEDED)]
