"""``python -m coordinator``: the command-line client (see ``coordinator.cli``)."""

import sys

from coordinator.cli import main

sys.exit(main())
