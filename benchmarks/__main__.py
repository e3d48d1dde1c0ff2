"""``python -m benchmarks [options]`` (from the top folder of a checkout): see :mod:`benchmarks.runner`."""

import sys

from benchmarks.runner import main

if __name__ == "__main__":
    sys.exit(main())
