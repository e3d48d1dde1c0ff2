"""``python -m extsrc <command>``: see :mod:`extsrc.cli`."""

import sys

from extsrc.cli import main

if __name__ == "__main__":
    sys.exit(main())
