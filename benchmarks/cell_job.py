"""What runs inside a cell's own process: open one loader, measure it, print its figures.

:func:`cell_main` is the entry point of the ``job.py`` script that
:func:`benchmarks.cells.run_cell` starts; it prints one line, the
:data:`~benchmarks.cells.RESULT_MARK` and the figures as JSON.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Sequence

from benchmarks.cells import MB, RESULT_MARK
from benchmarks.loaders import WORKERS, Opened, expected_indices, open_loader
from benchmarks.measure import measure
from benchmarks.ray_bench import RAY_LOADERS, open_ray_loader
from benchmarks.workloads import ALL_WORKLOADS


def _open(loader: str, workload: str, consumed: bool = False) -> Opened:
    if loader in RAY_LOADERS:
        return open_ray_loader(loader, workload, WORKERS)
    return open_loader(loader, workload, WORKERS, "fork", consumed)

def _throughput_cell(loader: str, workload: str, seconds: float, warmup_s: float,
                     consumed: bool = False) -> Dict[str, Any]:
    w = ALL_WORKLOADS[workload]
    take, indices, close = _open(loader, workload, consumed)
    try:
        batches, elapsed, cpu, total, last = measure(take, seconds, warmup_s)
        extra = take.figures() if hasattr(take, "figures") else {}  # a loader's own figures
        got = indices(last)
        expected = expected_indices(loader, total - 1, w.batch_size)
        if got != expected:
            raise RuntimeError(f"{loader}: batch {total - 1} holds samples {got[:4]}..., "
                               f"expected {expected[:4]}...")
    finally:
        close()
    samples_per_s = batches * w.batch_size / elapsed
    if "faults" in cpu:
        cpu["faults_per_sample"] = cpu.pop("faults") / (batches * w.batch_size)
    result = {
        "batches": batches,
        "elapsed_s": elapsed,
        "samples_per_s": samples_per_s,
        "mb_per_s": samples_per_s * w.sample_bytes / MB,
        **cpu,  # cores: consumer_cpu (consuming process), loader_cpu (it and its workers), other_cpu
        **extra,
    }
    if w.spin_s:
        result["ideal_fraction"] = samples_per_s / (WORKERS / w.spin_s)
    return result

def _memory_cell(loader: str, workload: str, seconds: float, warmup_s: float) -> Dict[str, Any]:
    """Resident memory of an extsrc loader's workers after a run (VmRSS, bytes, mean of workers)."""
    take, _indices, close = _open(loader, workload)
    try:
        measure(take, seconds, warmup_s)
        rss = [_resident_bytes(pid) for pid in take.source.worker_pids()]  # type: ignore[attr-defined]
    finally:
        close()
    return {"worker_rss_bytes": sum(rss) / len(rss)}

def _resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

def cell_main(argv: Sequence[str]) -> int:
    """Entry point of a cell subprocess: runs one cell, prints its figures as one JSON line."""
    spec = json.loads(argv[0])
    if spec.get("kind") == "images":
        from benchmarks.image_loaders import image_cell

        result = image_cell({k: v for k, v in spec.items() if k != "kind"})
    elif spec.get("kind") == "h2d":
        from benchmarks.transfer import transfer_cell

        result = transfer_cell({k: v for k, v in spec.items() if k != "kind"})
    elif spec.get("kind") == "remote":
        from benchmarks.remote import remote_cell

        result = remote_cell(spec)
    elif spec.get("kind") == "memory":
        result = _memory_cell(spec["loader"], spec["workload"], spec["seconds"], spec["warmup_s"])
    else:
        result = _throughput_cell(spec["loader"], spec["workload"], spec["seconds"], spec["warmup_s"],
                                  spec.get("consumed", False))
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0

