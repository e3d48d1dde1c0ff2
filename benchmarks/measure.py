"""Measuring a cell: batches taken for a time, and the CPU used by the loader and by others."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, Optional

Take = Callable[[], Any]

def _busy_ticks() -> Optional[int]:
    """CPU ticks all processes of the machine spent busy so far (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal

def _tree_ticks(root: int) -> Optional[int]:
    """CPU ticks used so far by ``root`` and its descendants still alive (None off Linux)."""
    return _tree_sum(root, (11, 12))  # utime, stime


def _tree_faults(root: int) -> Optional[int]:
    """Minor page faults so far of ``root`` and its descendants still alive (None off Linux)."""
    return _tree_sum(root, (7,))  # minflt


def _tree_sum(root: int, fields_wanted) -> Optional[int]:
    total, stack, seen = 0, [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(fields[i]) for i in fields_wanted)
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    stack += [int(child) for child in f.read().split()]
        except (OSError, ValueError, IndexError):
            if pid == root:
                return None
    return total

class CpuMeter:
    """Cores used by this cell (its process and workers) and by everything else, and the
    minor page faults of the cell's processes."""

    def __init__(self):
        pid = os.getpid()
        self.start = (_busy_ticks(), _tree_ticks(pid), _tree_faults(pid), time.perf_counter())

    def stop(self) -> Dict[str, float]:
        pid = os.getpid()
        busy, own, faults, now = _busy_ticks(), _tree_ticks(pid), _tree_faults(pid), time.perf_counter()
        busy0, own0, faults0, then = self.start
        if None in (busy, own, busy0, own0):
            return {}
        ticks = os.sysconf("SC_CLK_TCK") * (now - then)
        figures = {"loader_cpu": (own - own0) / ticks,
                   "other_cpu": max(0.0, ((busy - busy0) - (own - own0)) / ticks)}
        if faults is not None and faults0 is not None:
            figures["faults"] = faults - faults0  # minor page faults of the cell and its workers
        return figures

def measure(take: Take, seconds: float, warmup_s: float, warmup_batches: int = 8):
    """Skips a warm-up, then takes batches for ``seconds``.

    Returns (timed batches, elapsed s, CPU figures, all batches taken, last batch).
    """
    started = time.perf_counter()
    total = 0
    batch = None
    while total < warmup_batches or time.perf_counter() - started < warmup_s:
        batch = take()
        total += 1
    meter = CpuMeter()
    cpu = time.process_time()
    begin = time.perf_counter()
    counted = 0
    while True:
        batch = take()
        counted += 1
        now = time.perf_counter()
        if now - begin >= seconds:
            break
    figures = {"consumer_cpu": (time.process_time() - cpu) / (now - begin), **meter.stop()}
    return counted, now - begin, figures, total + counted, batch
