"""``python -m peerckpt.launch`` is the ``peerckpt`` command."""

import sys

from peerckpt.launch.cli import main

sys.exit(main())
