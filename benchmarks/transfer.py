"""``python -m extsrc bench --h2d``: batches from worker processes to a GPU, in GB/s.

The large workload (4 MiB uint8 samples, batch 16, 2 workers, fork) is
copied to GPU 0 the way a training loop does: each batch is queued with
``.to("cuda", non_blocking=True)``, and the loop waits for a batch's copy
only when the next batch has been taken (one copy in flight). Loaders:

* ``TorchLoader(pin_memory=True)``: the shared memory page-locked once; the
  copy is a DMA from it;
* ``TorchLoader(device="cuda", pin_memory=True)``: the loader queues the copy
  itself, on a side stream;
* ``DataLoader(pin_memory=True)``: its pinning thread copies every batch into
  page-locked memory, then the DMA;
* ``TorchLoader()`` and ``DataLoader()`` with pageable memory: CUDA stages
  each copy through its own page-locked buffer.

Every cell runs in a fresh process and checks that the last batch reached the
GPU with the right samples. Needs PyTorch with CUDA and a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from benchmarks.cells import run_cell
from benchmarks.loaders import EXTSRC, WORKERS, expected_indices
from benchmarks.packages import installed, version
from benchmarks.workloads import LARGE

GB = 1e9  # GB/s figures are in 10^9 bytes per second
REFERENCE = "torchloader-pinned"


@dataclass(frozen=True)
class TransferLoader:
    """One loader of the table: its key (the cell's), its name, and how it is built."""

    key: str
    name: str
    engine: bool  # extsrc (TorchLoader) or PyTorch's DataLoader
    pin_memory: bool
    loader_copies: bool = False  # TorchLoader(device="cuda"): the loader queues the copies


LOADERS = (
    TransferLoader(REFERENCE, 'TorchLoader(pin_memory=True), .to("cuda", non_blocking=True)', True, True),
    TransferLoader("torchloader-device", 'TorchLoader(device="cuda", pin_memory=True)', True, True, True),
    TransferLoader("dataloader-pinned", 'DataLoader(pin_memory=True), .to("cuda", non_blocking=True)',
                   False, True),
    TransferLoader("torchloader-pageable", 'TorchLoader(), pageable, .to("cuda")', True, False),
    TransferLoader("dataloader-pageable", 'DataLoader(), pageable, .to("cuda")', False, False),
)
_BY_KEY = {loader.key: loader for loader in LOADERS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--h2d`` option of ``python -m extsrc bench``."""
    parser.add_argument("--h2d", action="store_true",
                        help="measure batches copied to GPU 0 in GB/s (large workload): "
                             "TorchLoader page-locked, DataLoader(pin_memory=True), and both "
                             "pageable (instead of the synthetic workloads; needs a GPU)")


def _open(loader: TransferLoader):
    """``(take, close)``: ``take()`` queues the next batch's copy and returns (host, device) batches."""
    import torch
    from torch.utils.data import DataLoader

    from benchmarks.loaders import bench_dataset

    if loader.engine:
        import extsrc
        from extsrc.torch import TorchLoader

        from benchmarks.workloads import CALLBACKS

        source = extsrc.ParallelSource(CALLBACKS[LARGE.name], LARGE.batch_size, num_workers=WORKERS,
                                       start_method="fork")
        torch_loader = TorchLoader(source, device="cuda" if loader.loader_copies else None,
                                   pin_memory=loader.pin_memory)  # starts the workers before CUDA

        def close() -> None:
            torch_loader.close()
            source.close()

        batches = iter(torch_loader)
    else:
        data_loader = DataLoader(bench_dataset(LARGE.name), batch_size=LARGE.batch_size,
                                 num_workers=WORKERS, persistent_workers=True,
                                 multiprocessing_context="fork", pin_memory=loader.pin_memory)
        batches = iter(data_loader)

        def close() -> None:
            nonlocal batches
            batches = None  # the iterator's finaliser shuts the persistent workers down

    if not torch.cuda.is_available():
        close()
        raise RuntimeError("--h2d needs a GPU, but torch.cuda.is_available() is False")
    device = torch.device("cuda", 0)
    pending: Dict[str, Any] = {"event": None}

    def take():
        host = next(batches)
        moved = host if loader.loader_copies else host.to(device, non_blocking=loader.pin_memory)
        event = torch.cuda.Event()
        event.record()
        if pending["event"] is not None:
            pending["event"].synchronize()  # the previous batch's copy, overlapped with this take
        pending["event"] = event
        return host, moved

    return take, close


def transfer_cell(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One loader's figures (runs in a cell's fresh process)."""
    import torch

    from benchmarks.measure import measure
    from benchmarks.workloads import sample_index

    loader = _BY_KEY[spec["loader"]]
    take, close = _open(loader)
    try:
        batches, elapsed, cpu, total, (_host, moved) = measure(take, spec["seconds"], spec["warmup_s"])
        torch.cuda.synchronize()
        got = [sample_index(sample) for sample in moved.cpu().numpy()]
        expected = expected_indices(EXTSRC, total - 1, LARGE.batch_size)  # both loaders go in order
        if moved.device.type != "cuda" or got != expected:
            raise RuntimeError(f"{loader.name}: the last batch on {moved.device} holds samples "
                               f"{got[:4]}..., expected {expected[:4]}...")
    finally:
        close()
    cpu.pop("faults", None)
    return {"batches": batches, "elapsed_s": elapsed,
            "gb_per_s": batches * LARGE.batch_size * LARGE.sample_bytes / elapsed / GB, **cpu}


def run(args: argparse.Namespace, seconds: float, warmup_s: float, repeat: int) -> int:
    """Runs the ``--h2d`` table; 0 when every cell ran, 1 when one failed, 2 when it cannot run."""
    from extsrc.engine.cuda_state import gpu_visible

    visible, why = gpu_visible()
    if not visible:
        print(f"extsrc bench: --h2d copies batches to a GPU, but {why}", file=sys.stderr)
        return 2
    if not installed("torch"):
        print("extsrc bench: --h2d needs PyTorch with CUDA (pip install 'extsrc[torch]')", file=sys.stderr)
        return 2
    plan = [loader for r in range(repeat)
            for loader in (LOADERS if r % 2 == 0 else tuple(reversed(LOADERS)))]
    print(f"extsrc bench --h2d: {len(plan)} cells ({repeat} x {len(LOADERS)}), {seconds:g} s timed + "
          f"{warmup_s:g} s warm-up each, every cell in a fresh process", file=sys.stderr)
    runs: Dict[str, List[Dict[str, Any]]] = {loader.key: [] for loader in LOADERS}
    failures = []
    load_start = os.getloadavg()
    for n, loader in enumerate(plan, 1):
        result = run_cell({"kind": "h2d", "loader": loader.key, "seconds": seconds, "warmup_s": warmup_s},
                          args.timeout)
        if "error" in result:
            failures.append(f"{loader.name}: {result['error']}")
            print(f"  [{n}/{len(plan)}] {loader.name}: FAILED ({result['error']})", file=sys.stderr)
            continue
        runs[loader.key].append(result)
        print(f"  [{n}/{len(plan)}] {loader.name}: {result['gb_per_s']:.2f} GB/s", file=sys.stderr)
    print(f"\nPython {sys.version.split()[0]}, {os.cpu_count()} CPUs, torch {version('torch')}; "
          f"load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    print(f"Median of {repeat} run(s) per loader, {seconds:g} s timed after {warmup_s:g} s warm-up.\n")
    print(table(runs))
    for failure in failures:
        print(f"  failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


def table(runs: Dict[str, List[Dict[str, Any]]]) -> str:
    """The markdown table of the medians, with the reference's ratio to each loader."""
    def median(key: str, field: str) -> Optional[float]:
        values = [run[field] for run in runs[key] if field in run]
        return statistics.median(values) if values else None

    reference = median(REFERENCE, "gb_per_s")
    lines = [f"Batches to GPU 0, {LARGE.sample_bytes // (1 << 20)} MiB uint8 samples, batch "
             f"{LARGE.batch_size}, {WORKERS} workers, fork; one copy in flight:",
             "| loader | GB/s | cores used | TorchLoader(pin_memory=True) / this |", "|---|---|---|---|"]
    for loader in LOADERS:
        rate, cores = median(loader.key, "gb_per_s"), median(loader.key, "loader_cpu")
        ratio = ("1.00x (reference)" if loader.key == REFERENCE and rate is not None
                 else "n/a" if rate is None or reference is None else f"{reference / rate:.2f}x")
        lines.append(f"| {loader.name} | {'n/a' if rate is None else f'{rate:.2f}'} | "
                     f"{'' if cores is None else f'{cores:.2f}'} | {ratio} |")
    return "\n".join(lines)
