"""Fault injection: the chaos spec, the monkey that fires it at a running job, the fault
hooks it installs inside job processes, and storage faults.

Layer: beside the processes, under the launchers. It may import only the ground folder
(``peerckpt/``): the machine-level faults it asks of whatever runs the job go through a small
protocol of its own (``actions.Machines``), which a launcher meets, so it never names a
launcher. Nothing in production code imports it: the processes expose hooks
(``peerckpt/faults.py``) that this package fills through an entry point, and the launchers
(``launch/``, the seeded campaign ``launch/campaign.py`` among them) use only this package's
public surface below, never its modules.

- :class:`Chaos`: a chaos spec run beside one job (``peerckpt run --chaos``), and
  :class:`ActionKind`, what each of its actions does;
- :class:`FiredAction`: what firing one action did, a report's ``chaos`` entry;
- ``parse_chaos``: a spec's actions, checked; ``check_ray_campaign`` and ``generate_ray``: the
  rules of a seeded fault sequence on Ray (``peerckpt chaos --ray``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as the type checker sees them; loaded on use below
    from peerckpt.chaos.raysched import check_ray_campaign, generate_ray
    from peerckpt.chaos.session import Chaos
    from peerckpt.chaos.spec import ActionKind, FiredAction, parse_chaos

__all__ = [
    "ActionKind",
    "Chaos",
    "FiredAction",
    "check_ray_campaign",
    "generate_ray",
    "parse_chaos",
]

_LAZY = {
    "ActionKind": "peerckpt.chaos.spec",
    "Chaos": "peerckpt.chaos.session",
    "FiredAction": "peerckpt.chaos.spec",
    "parse_chaos": "peerckpt.chaos.spec",
    "check_ray_campaign": "peerckpt.chaos.raysched",
    "generate_ray": "peerckpt.chaos.raysched",
}


def __getattr__(name: str) -> Any:
    # Loaded on use: a job process that loads the fault hooks (``points``) through this
    # package needs none of the monkey's modules.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'peerckpt.chaos' has no attribute {name!r}")
