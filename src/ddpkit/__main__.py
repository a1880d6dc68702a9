"""``python -m ddpkit run ...``: the same as the ``ddpkit`` command."""

import sys

from ddpkit.launching.cli import main

sys.exit(main())
