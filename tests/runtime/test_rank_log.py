"""A torch error logged by a rank is one line: the trace torch appends to an error that
crossed C++ (pybind's "At: …" from a future's callback, c10's "Exception raised from …")
was logged with it, line by line, in every recovery; it is kept at debug level."""

from __future__ import annotations

import logging

import pytest
import torch

from peerckpt.errors import ConfigurationError, MembershipChanged
from peerckpt.runtime.inflight import InFlight
from peerckpt.runtime.rank import _looks_like_comm_error, _short


def _released_collective_error() -> BaseException:
    """What DDP's backward raises when the epoch's abort releases its all-reduce: the
    ``MembershipChanged`` of ``InFlight.release``, wrapped by torch as it crossed C++."""
    in_flight = InFlight()
    gloo: torch.futures.Future[object] = torch.futures.Future()
    waited = in_flight.issue(lambda: gloo, lambda value: value)
    in_flight.release("epoch 0 was aborted")
    with pytest.raises(RuntimeError) as exc:
        waited.wait()  # as DDP's reducer waits on it
    assert "At:" in str(exc.value)  # the noise, as torch makes it
    return exc.value


def test_an_error_through_a_futures_callback_is_logged_as_its_first_line(caplog) -> None:
    exc = _released_collective_error()
    with caplog.at_level(logging.DEBUG, logger="peerckpt.rank"):
        line = _short(exc)
    assert line == "MembershipChanged: epoch 0 was aborted"
    [full] = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert "At:" in full.getMessage() and "inflight.py" in full.getMessage()


def test_a_c10_trace_is_cut_and_a_one_line_error_is_left_as_it_is(caplog) -> None:
    c10 = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:5555\nException raised from recvBytes at Utils.hpp:787 (most recent "
        "call first):\nframe #0: c10::Error::Error(...) + 0x9d"
    )
    with caplog.at_level(logging.DEBUG, logger="peerckpt.rank"):
        assert _short(c10) == (
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
            "closed by peer [127.0.0.1]:5555"
        )
        assert _short(ValueError("plain")) == "ValueError: plain"
        assert _short(TimeoutError()) == "TimeoutError"
        wrapped = "Got the following error when running the callback: RuntimeError: [pair.cc"
        assert _short(RuntimeError(f"{wrapped}:537] Read error\n\nAt:\n  x.py(1): f")) == (
            "RuntimeError: [pair.cc:537] Read error"  # the type named once
        )
        assert len(_short(ValueError("x" * 500))) == 160
    full = [r.getMessage() for r in caplog.records]
    assert len(full) == 2 and "Exception raised from" in full[0] and "At:" in full[1]


@pytest.mark.parametrize(
    ("exc", "comm"),
    [
        (RuntimeError("[pair.cc:537] Read error [127.0.0.2]:8614: Connection reset by peer"), True),
        (RuntimeError("Connection closed by peer [127.0.0.3]:41062"), True),
        (MembershipChanged("epoch 0 was aborted"), True),
        (ValueError("expected a batch of 16 rows, got 15"), False),
        (RuntimeError("peerckpt.resilient: the function returned early"), False),
        (ConfigurationError("the connection string names no socket"), False),
    ],
)
def test_only_a_collective_s_error_waits_for_the_abort_notice(exc, comm) -> None:
    """The suspect window (30 s) is waited for only by errors a dead peer causes, told by
    their words; never by peerckpt's own refusals, whatever words they use."""
    assert _looks_like_comm_error(exc) is comm
