"""The exit status and reason of a launcher stopped by a signal (``launch/base.py``)."""

from __future__ import annotations

import signal

from peerckpt.launch.base import stopped_by


def test_a_signal_gives_128_plus_its_number_and_its_name() -> None:
    assert stopped_by(signal.SIGINT) == (130, "stopped by a signal (Ctrl-C)")
    assert stopped_by(None) == (130, "stopped by a signal (Ctrl-C)")  # a Ray host told to stop
    assert stopped_by(signal.SIGTERM) == (143, "stopped by SIGTERM")
    assert stopped_by(signal.SIGHUP) == (129, "stopped by SIGHUP")
