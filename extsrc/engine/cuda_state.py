"""Whether CUDA was initialised in this process (then ``fork`` is unsafe).

A forked child inherits a CUDA context it cannot use: CUDA calls there fail or
hang. The check needs no GPU and initialises nothing: it asks an already loaded
CUDA driver whether ``cuInit`` ran (a driver that was never loaded was never
initialised).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from typing import Tuple

_CUDA_ERROR_NOT_INITIALIZED = 3


def _driver_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


def cuda_initialized() -> bool:
    """True if this process has initialised the CUDA driver (by any library)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return True
        except Exception:
            pass
    if not _driver_loaded():
        return False
    try:
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    count = ctypes.c_int(0)
    status: int = driver.cuDeviceGetCount(ctypes.byref(count))  # a CUresult
    return status != _CUDA_ERROR_NOT_INITIALIZED


FORK_AFTER_CUDA = (
    "cannot start workers with start_method='fork': CUDA is already initialised in this "
    "process, and a forked worker inherits a CUDA context it cannot use. Start the workers "
    "before any CUDA use (ParallelSource.start(), or pipe.start_py_workers() before "
    "pipe.build() and before touching a GPU with DALI, CuPy or PyTorch), or use "
    "start_method='spawn' (py_start_method='spawn' in a pipeline)."
)


def gpu_visible() -> Tuple[bool, str]:
    """``(True, "")`` if an NVIDIA GPU looks usable here, else ``(False, why not)``.

    Initialises nothing (forking stays safe): it looks for the driver library
    and for a device node (``/dev/nvidia0``..., or ``/dev/dxg`` under WSL).
    A ``True`` is a good guess, not a promise; a ``False`` is reliable.
    """
    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_LAZY)
    except OSError:
        return False, "the NVIDIA driver (libcuda.so.1) is not installed or not visible here"
    if not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg")):
        return False, ("no NVIDIA GPU device (/dev/nvidia0, ...) is visible here; in a container "
                       "start it with --gpus all")
    return True, ""


def no_gpu_message(what: str, why: str, fix: str) -> str:
    """The error for asking for a GPU where there is none: ``what`` asked, ``why`` not, ``fix``."""
    return f"{what} needs a GPU, but {why}. {fix}"
