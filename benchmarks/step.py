"""The training-step cells: a fixed CPU-bound step per batch in the consuming process.

What a loader costs the training loop is not only the time it makes it wait:
its threads in the training process (and its workers, on the same cores)
take CPU from the step itself. A step cell takes a batch, then runs
:func:`training_step` (``STEP_CPU_S`` of one thread's CPU: on a busy core it
takes longer in wall time), and counts steps per second. The ``ready``
loader hands the same prepared batch every time: the step rate with no
loader at all, which every other loader is compared with.
"""

from __future__ import annotations

import time
from typing import Any, Dict

import numpy as np

from benchmarks.loaders import READY, STEP_CPU_S
from benchmarks.measure import measure
from benchmarks.workloads import ALL_WORKLOADS


def training_step() -> None:
    """``STEP_CPU_S`` of this thread's CPU time (a busy loop on its CPU clock)."""
    end = time.thread_time() + STEP_CPU_S
    while time.thread_time() < end:
        pass


def step_cell(loader: str, workload: str, seconds: float, warmup_s: float) -> Dict[str, Any]:
    """Steps/s of a loop that takes a batch of ``loader`` and runs :func:`training_step`."""
    from benchmarks.cells import open_cell_loader

    w = ALL_WORKLOADS[workload]
    if loader == READY:
        batch = np.full((w.batch_size, w.sample_bytes), 0x5A, np.uint8)
        take, close = (lambda: batch), (lambda: None)
    else:
        take, _indices, close = open_cell_loader(loader, workload)

    def step() -> Any:
        taken = take()
        training_step()
        return taken

    try:
        steps, elapsed, cpu, _total, _last = measure(step, seconds, warmup_s)
    finally:
        close()
    return {"steps_per_s": steps / elapsed, "samples_per_s": steps * w.batch_size / elapsed,
            "elapsed_s": elapsed, "batches": steps, **cpu}
