"""A chaos spec fired at one running job: what a launcher runs beside the job it started."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from peerckpt.chaos.actions import FaultActions
from peerckpt.chaos.monkey import ChaosMonkey, StatusSource
from peerckpt.chaos.spec import parse_chaos

if TYPE_CHECKING:
    from peerckpt.launch.base import Launcher


class Chaos:
    """Parse a chaos spec (``"kill rank=2 at=30; kill node=1 at=60"``) up front, so that a bad
    spec fails before anything starts; ``start`` it once the job runs, ``stop`` it before the
    job's processes are stopped (it thaws what it froze)."""

    def __init__(self, spec: str) -> None:
        self.actions = parse_chaos(spec)
        self._monkey: ChaosMonkey | None = None
        self._faults: FaultActions | None = None

    @property
    def needs_fault_dir(self) -> bool:
        """Do the faults need hooks inside the job's processes (phase points, network)?"""
        return any(
            a.during is not None or a.kind in ("partition_node", "slow_node") for a in self.actions
        )

    def start(self, launcher: Launcher, status: StatusSource, fault_dir: str | None) -> None:
        self._faults = FaultActions(launcher, fault_dir)
        self._monkey = ChaosMonkey(self.actions, status, self._faults)
        self._monkey.start()

    def stop(self) -> None:
        if self._monkey is not None:
            self._monkey.stop()
        if self._faults is not None:
            self._faults.wake_all()

    @property
    def fired(self) -> list[dict[str, Any]]:
        """One record per action that fired (or was skipped), in order."""
        return self._monkey.fired if self._monkey is not None else []
