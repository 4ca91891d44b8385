"""``python -m coordinator``: the command-line client (see ``coordinator.ops.cli``)."""

import sys

from coordinator.ops.cli import main

if __name__ == "__main__":
    sys.exit(main())
