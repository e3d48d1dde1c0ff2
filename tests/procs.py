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


def own_shm_entries(pids) -> set:
    """The /dev/shm entries that extsrc named for one of ``pids`` (``extsrc-<pid>-...``).

    Only these are the test's own: other programs on the machine (other test
    runs included) add and remove entries of their own at any time.
    """
    prefixes = tuple(f"extsrc-{pid}-" for pid in pids)
    try:
        return {entry for entry in os.listdir("/dev/shm") if entry.startswith(prefixes)}
    except OSError:
        return set()


def named_shm_in_use(pids) -> list:
    """Paths in /dev/shm that processes ``pids`` hold open or mapped under a name still there.

    An extsrc segment never has a name (memfd, or an unnamed /dev/shm file),
    so for extsrc's processes this is empty whatever else the machine does.
    """
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/") and not target.endswith(" (deleted)"):
                found.add(target)
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = line.split(None, 5)[5].strip() if len(line.split(None, 5)) == 6 else ""
                    if path.startswith("/dev/shm/") and not path.endswith(" (deleted)"):
                        found.add(path)
        except OSError:
            continue
    return sorted(found)
