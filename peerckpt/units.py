"""Quantities for people: byte counts in the units a reader expects."""

from __future__ import annotations


def human(nbytes: float) -> str:
    """Format a byte count for people."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"
