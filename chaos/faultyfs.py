"""A local filesystem that fails or slows writes on demand: storage faults for the durable tier.

``faulty://<path>`` (registered with fsspec by this package) stores files at ``<path>`` on
the local disk, like ``file://``. What goes wrong is read, at every write, from a fault file
``.peerckpt-faults`` in the written file's directory or any directory above it, so every
process of a job sees the same faults and a test can switch them on and off::

    enospc step=10 after=50000    a file under step-000000000010/ fails with ENOSPC ("No
                                  space left on device") once it would hold more than
                                  50000 bytes; what fit is written, as on a full disk
    eio step=*                    every write under any step directory fails with EIO
    slow step=10 delay=2.0        each file under step 10 sleeps 2 s at its first write

One rule per line; ``step=*`` matches every step; ``#`` starts a comment.
"""

from __future__ import annotations

import enum
import errno
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

FAULT_FILE = ".peerckpt-faults"
_STEP = re.compile(r"step-(\d{12})")


class FaultKind(enum.Enum):
    """What a rule does to a write; its value is the rule's first word."""

    ENOSPC = "enospc"  # the disk fills up after ``after`` bytes of the file
    EIO = "eio"  # every write fails
    SLOW = "slow"  # the file's first write sleeps ``delay`` seconds


@dataclass(frozen=True)
class Rule:
    kind: FaultKind
    step: int | None  # None: every step
    after: int = 0
    delay: float = 0.0


_KINDS = {k.value for k in FaultKind}


def parse_rules(text: str) -> list[Rule]:
    """The rules of a fault file; a malformed line raises ValueError naming it."""
    rules = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, *fields = line.split()
        args = dict(f.split("=", 1) for f in fields if "=" in f)
        if kind not in _KINDS or "step" not in args:
            raise ValueError(f"bad fault rule {raw!r}: want 'enospc|eio|slow step=N|* [...]'")
        step = None if args["step"] == "*" else int(args["step"])
        rules.append(
            Rule(FaultKind(kind), step, int(args.get("after", 0)), float(args.get("delay", 0)))
        )
    return rules


def rules_for(path: str) -> list[Rule]:
    """The rules that apply to writes of ``path``."""
    m = _STEP.search(path)
    if m is None:
        return []
    step = int(m.group(1))
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        candidate = os.path.join(directory, FAULT_FILE)
        if os.path.exists(candidate):
            with open(candidate) as f:
                return [r for r in parse_rules(f.read()) if r.step in (None, step)]
        parent = os.path.dirname(directory)
        if parent == directory:
            return []
        directory = parent


class FaultyOpener(LocalFileOpener):
    """A local file whose writes obey the fault rules in force when each write happens."""

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        first, self._written_once = not getattr(self, "_written_once", False), True
        for rule in rules_for(self.path):
            if rule.kind is FaultKind.SLOW:
                if first:
                    time.sleep(rule.delay)
            elif rule.kind is FaultKind.EIO:
                raise OSError(errno.EIO, f"Input/output error (injected) writing {self.path}")
            elif rule.kind is FaultKind.ENOSPC and self.tell() + n > rule.after:
                fits = max(0, rule.after - self.tell())
                if fits:
                    super().write(memoryview(data).cast("B")[:fits])
                    self.flush()
                raise OSError(
                    errno.ENOSPC, f"No space left on device (injected) writing {self.path}"
                )
        written: int = super().write(data)
        return written


class FaultyFileSystem(LocalFileSystem):
    """``faulty://``: local files with injected write faults (see the module docstring)."""

    protocol = ("faulty",)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str) and path.startswith("faulty://"):
            path = path[len("faulty://") :]
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if not any(c in mode for c in "wxa"):
            return super()._open(path, mode, block_size, **kwargs)
        if self.auto_mkdir:
            self.makedirs(self._parent(path), exist_ok=True)
        return FaultyOpener(path, mode, fs=self, **kwargs)
