"""Shared fixtures: every test must leave no worker process and no /dev/shm entry."""

from __future__ import annotations

import os
import signal
import time

import pytest

from procs import live_children


def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def no_leftovers():
    """Fails a test that leaves extsrc workers running or files in /dev/shm."""
    before = _shm_entries()
    children_before = set(live_children())
    yield
    deadline = time.monotonic() + 5  # a pool shut down after a fault reaps its workers in its thread
    leftover = set(live_children()) - children_before
    while leftover and time.monotonic() < deadline:
        time.sleep(0.05)
        leftover = set(live_children()) - children_before
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert not leftover, f"child processes left running: {sorted(leftover)}"
    new = {e for e in _shm_entries() - before if "extsrc" in e or e.startswith("psm_")}
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
