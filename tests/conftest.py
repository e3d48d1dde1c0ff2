"""Shared fixtures: every test must leave no worker process and no /dev/shm entry."""

from __future__ import annotations

import multiprocessing
import os

import pytest


def _shm_entries() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def no_leftovers():
    """Fails a test that leaves extsrc workers running or files in /dev/shm."""
    before = _shm_entries()
    yield
    leftover = [p for p in multiprocessing.active_children() if p.name.startswith("extsrc-worker")]
    for process in leftover:
        process.kill()
        process.join(5)
    assert not leftover, f"worker processes left running: {leftover}"
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
