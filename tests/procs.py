"""Processes of the test process, read from /proc (so that tests need no private engine state)."""

from __future__ import annotations

import os


def live_children() -> list:
    """Pids of this process's children that are still running (zombies excluded)."""
    pids = []
    me = os.getpid()
    for task in os.listdir(f"/proc/{me}/task"):
        try:
            with open(f"/proc/{me}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
                if any(k in command for k in (b"forkserver", b"resource_tracker")):
                    continue  # multiprocessing's own helpers live as long as the test process
        except OSError:
            continue
        alive.append(pid)
    return alive
