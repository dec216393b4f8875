"""``python -m attnlab ...`` runs the command-line tool (torchrun needs a module path)."""

import sys

from attnlab.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
