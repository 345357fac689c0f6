"""A training script that dies before its decorated function ever runs: its top level reads
a data file that is not there, as a first run of an adapted script often does."""

import peerckpt  # noqa: F401

raise FileNotFoundError("[Errno 2] No such file or directory: 'data/train.bin'")
