"""How a worker process's C allocator keeps the memory of samples it has let go.

A worker makes a sample (the callback's array, the bytes a client read off a
socket), copies it into shared memory and lets it go, many times a second.
glibc's allocator gives memory of 128 KiB and more back to the kernel when it
is freed (``mmap``/``munmap``, or trimming the top of the heap), so the next
sample of that size is faulted in anew, page by page: measured with 1 MiB
objects read by aiohttp (``bench --remote``, bandwidth row), 40-80 page faults
per sample and a third of the workers' CPU in the kernel. glibc raises its
threshold by itself after the first such free, but keeps trimming the heap
once 2x that size is free at its top, which samples in flight together keep
doing.

A worker is extsrc's process and lives for as long as its pool: it keeps the
memory it has used, up to the limits below, to make the next samples with.
Its memory stays bounded by what it had in use at its peak.

Left as glibc sets it when the user chose (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, or ``glibc.malloc`` in ``GLIBC_TUNABLES``), and on
other C libraries (no ``mallopt``).
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Optional

from extsrc.engine.policy import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES  # why: there

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

# glibc's mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def user_chose() -> bool:
    """Whether the environment sets glibc's allocator thresholds itself."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return True
    return "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def _mallopt() -> Optional[CFuncPtr]:
    """The C library's ``mallopt``; None where there is none (not glibc)."""
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None


def available() -> bool:
    """Whether this process's C library can be told (glibc's ``mallopt``)."""
    return _mallopt() is not None


def keep_freed_memory() -> bool:
    """In a worker: has glibc keep freed memory for reuse (see the module docstring).
    Returns whether the settings were applied."""
    mallopt = None if user_chose() else _mallopt()
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # Setting one threshold turns glibc's dynamic adjustment off for both: set both.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
