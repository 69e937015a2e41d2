"""``python -m smpckpt``: the same CLI as the ``smpckpt`` console script."""

import sys

from smpckpt.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
