"""What is installed, asked without importing it (the bench imports its peers only in cells)."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from typing import Optional


def installed(module: str) -> bool:
    """Whether ``module`` (dotted name) can be imported here, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` (a pip name), or ``None`` if it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
