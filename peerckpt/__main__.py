"""``python -m peerckpt`` is the ``peerckpt`` command."""

import sys

from peerckpt.cli import main

sys.exit(main())
