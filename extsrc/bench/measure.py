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
    total, stack, seen = 0, [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    stack += [int(child) for child in f.read().split()]
        except (OSError, ValueError, IndexError):
            if pid == root:
                return None
    return total

class CpuMeter:
    """Cores used by this cell (its process and workers) and by everything else."""

    def __init__(self):
        self.start = (_busy_ticks(), _tree_ticks(os.getpid()), time.perf_counter())

    def stop(self) -> Dict[str, float]:
        busy, own, now = _busy_ticks(), _tree_ticks(os.getpid()), time.perf_counter()
        busy0, own0, then = self.start
        if None in (busy, own, busy0, own0):
            return {}
        ticks = os.sysconf("SC_CLK_TCK") * (now - then)
        return {"loader_cpu": (own - own0) / ticks,
                "other_cpu": max(0.0, ((busy - busy0) - (own - own0)) / ticks)}

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
