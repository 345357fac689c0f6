"""A training script that dies before its decorated function ever runs."""

import peerckpt  # noqa: F401

raise SystemExit("boom at import")
