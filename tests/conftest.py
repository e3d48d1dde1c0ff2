"""Shared fixtures: every test must leave no worker process and no /dev/shm entry.

Tests marked ``cuda`` (``tests/gpu/``, ``tests/dali/test_cuda.py``) are skipped
without an NVIDIA GPU, asked once per run; tests marked ``ray`` are also ``slow`` (the fast
lane, ``-m "not slow"``, leaves them out).
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from procs import live_children, own_shm_entries

# Asked of the CUDA driver in a child process (no library needed): initialising CUDA in the
# pytest process would forbid the fork tests.
_GPU_PROBE = (
    "import ctypes; d = ctypes.CDLL('libcuda.so.1'); n = ctypes.c_int(0); "
    "print(n.value if d.cuInit(0) == 0 and d.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0)"
)
_GPU_PROBE_TIMEOUT_S = 120  # a first cuInit can take long on a large machine


def _has_gpu() -> bool:
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    try:
        result = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True,
                                timeout=_GPU_PROBE_TIMEOUT_S)
        return int(result.stdout.strip() or 0) > 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return False


def pytest_collection_modifyitems(config, items):
    # The Ray tests start a local Ray (seconds each), or a cluster: not for the fast lane.
    # (Markers, not keywords: a parameter's id "cuda" or "ray" is a keyword too.)
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.slow)
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items or _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_leftovers():
    """Fails a test that leaves extsrc workers running or files in /dev/shm (its own: those of
    this process and its children; other programs' entries come and go)."""
    children_before = set(live_children())
    seen = {os.getpid()} | children_before
    before = own_shm_entries(seen)
    yield
    deadline = time.monotonic() + 5  # a pool shut down after a fault reaps its workers in its thread
    seen |= set(live_children())
    leftover = set(live_children()) - children_before
    while leftover and time.monotonic() < deadline:
        time.sleep(0.05)
        leftover = set(live_children()) - children_before
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert not leftover, f"child processes left running: {sorted(leftover)}"
    new = own_shm_entries(seen) - before
    assert not new, f"/dev/shm entries left behind: {new}"


@pytest.fixture(scope="session")
def small_dev_shm():
    """A command prefix that runs a program with its own 16 MiB /dev/shm; skips where impossible."""
    from faultkit import unshare_small_dev_shm

    wrap = unshare_small_dev_shm("16m")
    if wrap is None:
        pytest.skip("needs `unshare -m` (root or user namespaces) to mount a private small /dev/shm")
    return wrap


START_METHODS = ["fork", "spawn", "forkserver"]
