"""Fault injection: the chaos spec, the monkey that fires it at a running job, the fault
hooks it installs inside job processes, storage faults, and the seeded campaign.

Layer: top. It may import anything: it drives launchers and installs hooks in every process
kind. Nothing in production code imports it: the processes expose hooks
(``peerckpt/faults.py``) that this package fills through an entry point, and launchers and
the CLI use only this package's public surface below, never its modules.

- :class:`Chaos`: a chaos spec run beside one job (``peerckpt run --chaos``), and
  :class:`ActionKind`, what each of its actions does;
- ``run_campaign``, ``format_table``, ``write_json``, ``default_json_path``: the seeded
  campaign (``peerckpt chaos``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ActionKind",
    "Chaos",
    "default_json_path",
    "format_table",
    "run_campaign",
    "write_json",
]

_LAZY = {
    "ActionKind": "peerckpt.chaos.spec",
    "Chaos": "peerckpt.chaos.session",
    "run_campaign": "peerckpt.chaos.campaign",
    "format_table": "peerckpt.chaos.campaign",
    "write_json": "peerckpt.chaos.campaign",
    "default_json_path": "peerckpt.chaos.campaign",
}


def __getattr__(name: str) -> Any:
    # Loaded on use: the campaign imports the launchers, which use ``Chaos``.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'peerckpt.chaos' has no attribute {name!r}")
