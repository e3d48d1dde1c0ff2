"""GPU tests of the PyTorch and CuPy layers: marked ``cuda``, skipped without an NVIDIA GPU.

The probe runs in a child process through the CUDA driver itself (no library
needed): initialising CUDA in the pytest process would forbid the fork tests.
"""

from __future__ import annotations

import glob
import subprocess
import sys

import pytest

_PROBE = (
    "import ctypes; d = ctypes.CDLL('libcuda.so.1'); n = ctypes.c_int(0); "
    "print(n.value if d.cuInit(0) == 0 and d.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0)"
)
_PROBE_TIMEOUT_S = 120  # a first cuInit can take long on a large machine


def _has_gpu() -> bool:
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    try:
        result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                                timeout=_PROBE_TIMEOUT_S)
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
