"""``python -m extsrc bench``: runs the benchmarks of a source checkout.

The benchmarks are not part of the installed package: they live in the
top-level ``benchmarks/`` folder of extsrc's source, next to ``extsrc/``, and
run as ``python -m benchmarks`` from that folder. This command finds them
there when extsrc is imported from a checkout (``PYTHONPATH`` or
``pip install -e .``) and runs them; otherwise it says where they are.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import List, Optional

import extsrc

PACKAGE = "benchmarks"
CHECKOUT_FILES = ("setup.cfg", "pyproject.toml")  # the top folder of a source checkout holds one


def checkout_root() -> str:
    """The folder that holds the ``extsrc`` package being run (a checkout's top folder, if it is one)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(extsrc.__file__)))


def _not_found(folder: str, why: str) -> int:
    print(f"extsrc bench: {why}. The benchmarks are not installed with the package: they are the "
          f"'{PACKAGE}/' folder of extsrc's source, next to 'extsrc/' (looked for {folder}). In a "
          f"source checkout, run them from its top folder with 'python -m {PACKAGE} [options]' "
          "(or install the checkout with 'pip install -e .' and run 'python -m extsrc bench' again).",
          file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    """Runs ``benchmarks.runner.main(argv)`` from the checkout extsrc is imported from; 2 if absent."""
    root = checkout_root()
    folder = os.path.join(root, PACKAGE)
    if not os.path.isfile(os.path.join(folder, "runner.py")):
        return _not_found(folder, f"no benchmarks next to the extsrc package in {root}")
    if not any(os.path.isfile(os.path.join(root, name)) for name in CHECKOUT_FILES):
        # e.g. site-packages, where a 'benchmarks' folder would be another distribution's
        return _not_found(folder, f"{root} is not a source checkout of extsrc (no {' or '.join(CHECKOUT_FILES)})")
    sys.path.insert(0, root)  # first: a 'benchmarks' folder in the working directory must not shadow ours
    runner = importlib.import_module(f"{PACKAGE}.runner")
    found = os.path.dirname(os.path.abspath(runner.__file__ or ""))
    if os.path.realpath(found) != os.path.realpath(folder):
        return _not_found(folder, f"another '{PACKAGE}' package was imported, from {found}")
    return int(runner.main(argv) or 0)
