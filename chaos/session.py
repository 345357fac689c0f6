"""A chaos spec fired at one running job: what a launcher runs beside the job it started."""

from __future__ import annotations

import json
import os

from peerckpt.chaos.actions import FaultActions, Machines
from peerckpt.chaos.monkey import ChaosMonkey, StatusSource
from peerckpt.chaos.points import GATES
from peerckpt.chaos.spec import FiredAction, check_targets, parse_chaos


class Chaos:
    """Parse a chaos spec (``"kill rank=2 at=30; kill node=1 at=60"``) up front, so that a bad
    spec fails before anything starts. Call order: ``check`` (targets that cannot exist are
    refused), ``prepare`` the job's fault directory before its processes start (the steps its
    ranks announce), ``start`` once the job runs, ``stop`` before the job's processes are
    stopped (it thaws what it froze and lets held ranks go), then ``unfired``."""

    def __init__(self, spec: str) -> None:
        self.actions = parse_chaos(spec)
        self._monkey: ChaosMonkey | None = None
        self._faults: FaultActions | None = None

    def check(self, nodes: int, nproc_per_node: int, spare_nodes: int) -> None:
        """Raise ConfigurationError for an action whose rank or node cannot exist."""
        check_targets(self.actions, nodes, nproc_per_node, spare_nodes)

    @property
    def needs_fault_dir(self) -> bool:
        """Do the faults need hooks inside the job's processes? Always: every action waits
        for its step at the ranks' step points."""
        return bool(self.actions)

    def prepare(self, fault_dir: str) -> None:
        """Write the steps the actions wait for where the job's ranks read them."""
        path = os.path.join(fault_dir, GATES)
        with open(path + ".tmp", "w") as f:
            json.dump(sorted({a.at for a in self.actions}), f)
        os.replace(path + ".tmp", path)

    def start(self, launcher: Machines, status: StatusSource, fault_dir: str | None) -> None:
        self._faults = FaultActions(launcher, fault_dir)
        self._monkey = ChaosMonkey(self.actions, status, self._faults)
        self._monkey.start()

    def stop(self) -> None:
        if self._monkey is not None:
            self._monkey.stop()
        if self._faults is not None:
            self._faults.wake_all()

    @property
    def fired(self) -> list[FiredAction]:
        """One record per action that fired (or was skipped), in order."""
        return self._monkey.fired if self._monkey is not None else []

    @property
    def refusal(self) -> str | None:
        """Why an action can never fire, once the running job shows it (a step past the
        script's loop): the launcher then fails the job at once."""
        return self._monkey.refusal if self._monkey is not None else None

    def unfired(self) -> list[str]:
        """A line per action that never fired, saying why (every action, before ``start``)."""
        if self._monkey is None:
            return [f"chaos action '{a.text}' never fired: the job never ran" for a in self.actions]
        return self._monkey.unfired()
