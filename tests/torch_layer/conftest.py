"""PyTorch-layer tests (extsrc.torch): skipped where PyTorch is not installed."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is None:  # the torch extra is not installed
    collect_ignore_glob = ["test_*.py"]
