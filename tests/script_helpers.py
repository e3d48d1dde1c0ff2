"""What the scripts of ``run_isolated`` share: a small source, its epoch, waits with a guard.

The scripts run in a fresh interpreter with this folder on ``PYTHONPATH``, so spawn and
forkserver workers import this module by name to run :func:`eight`.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Iterable, List

import numpy as np

# A start or a short epoch takes well under a second; this only bounds a hang.
HANG_GUARD_S = 60.0
POLL_S = 0.001  # how often until() looks again


def eight(info) -> np.ndarray:
    """Samples ``[i, i]`` for positions 0..7, then the end of the epoch."""
    if info.idx_in_epoch >= 8:
        raise StopIteration
    return np.full(2, info.idx_in_epoch)


def epoch(source: Iterable) -> List[int]:
    """The first value of every sample of one epoch of ``source``, in order."""
    return [int(sample[0]) for batch in source for sample in batch]


def until(condition: Callable[[], bool], what: str, guard_s: float = HANG_GUARD_S) -> None:
    """Waits until ``condition()``; fails with ``what`` after ``guard_s``."""
    deadline = time.monotonic() + guard_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(POLL_S)


def waits_in(thread_ident: int, function: str) -> bool:
    """Whether the thread ``thread_ident`` is in ``function`` now (its innermost frame)."""
    frame = sys._current_frames().get(thread_ident)
    return frame is not None and frame.f_code.co_name == function


def children_of(parent: int) -> List[int]:
    """The live (not zombie) processes whose parent is ``parent``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(pid))
    return found
