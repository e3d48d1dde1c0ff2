"""DALI-layer tests: skipped without DALI; ``cuda`` tests skipped without a GPU."""

from __future__ import annotations

import glob
import subprocess
import sys

import pytest

try:
    import nvidia.dali  # noqa: F401
except ImportError:  # the DALI extra is not installed: nothing here can run
    collect_ignore_glob = ["test_*.py"]


def _has_gpu() -> bool:
    # Asked in a child process: initialising CUDA here would forbid the fork tests.
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    probe = "from nvidia.dali.backend import GetCUDADeviceCount as n; print(n())"
    try:
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        return int(result.stdout.strip() or 0) > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    cuda_items = [item for item in items if "cuda" in item.keywords]
    if not cuda_items or _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in cuda_items:
        item.add_marker(skip)
