"""python -m extsrc doctor: what works here, what the settings need, and advice."""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import platform
import time
from typing import List, Optional

import numpy as np

import extsrc
from extsrc.engine import (START_METHODS, Segment, default_prefetch, gpu_visible, limits, shm_backend,
                           streaming)


def _probe(info):
    return np.full((4,), info.idx_in_epoch, np.int32)


def _check_start_method(method: str) -> str:
    started = time.perf_counter()
    try:
        with extsrc.ParallelSource(_probe, 2, start_method=method, timeout=60) as src:
            batch = next(iter(src))
        assert int(batch[1][0]) == 1
    except Exception as exc:
        return f"FAILS: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return f"works (first batch after {time.perf_counter() - started:.2f} s)"


def _check_memfd() -> str:
    if not hasattr(os, "memfd_create"):
        return "not available (falls back to /dev/shm files)"
    try:
        segment = Segment(os.memfd_create("extsrc:doctor", os.MFD_CLOEXEC), "memfd", "doctor")
        segment.reserve(1 << 20)
        segment.close()
    except OSError as exc:
        return f"FAILS: {exc}"
    return "works (sample memory does not count against /dev/shm)"


def _version_of(module: str) -> Optional[str]:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:
        return None


def _cuda_devices() -> str:
    visible, why = gpu_visible()
    if not visible:
        return f"no GPU: {why}; GPU stages (device='mixed'/'gpu') are unavailable"
    driver = ctypes.CDLL("libcuda.so.1")
    if driver.cuInit(0) != 0:  # after the start-method checks: initialising CUDA here is fine
        return "CUDA driver present but cuInit failed (no usable GPU?)"
    count = ctypes.c_int(0)
    driver.cuDeviceGetCount(ctypes.byref(count))
    return f"CUDA driver present, {count.value} GPU(s)"


def needed_bytes(workers: int, batch_size: int, sample_bytes: int, outputs: int,
                 prefetch: int, batches_held: int) -> int:
    """Shared memory a source needs: a batch per slot kept (prefetch + batches_held), plus the
    first batch, which is written to overflow before the sample shapes are known; what the source
    itself checks at its first sample (:func:`extsrc.shm.limits.source_need`)."""
    return limits.source_need(batch_size * sample_bytes * outputs, prefetch + batches_held)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m extsrc doctor",
        description="Check what works here (shared memory, start methods, GPU, libraries), and "
                    "how much shared memory a source with these settings needs against what this "
                    "process may use. Exit code 1 when something needs fixing.",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default: 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per batch (default: 32)")
    parser.add_argument("--sample-bytes", type=int, default=224 * 224 * 3,
                        help="bytes of one sample of one output (default: a 224x224 RGB image)")
    parser.add_argument("--outputs", type=int, default=1, help="outputs per sample (default: 1)")
    parser.add_argument("--prefetch", type=int, default=None,
                        help="batches produced ahead (default: 2 per worker, as ParallelSource)")
    parser.add_argument("--batches-held", type=int, default=3,
                        help="batches the consumer keeps at once (default 3: what a DALI pipeline "
                             "with prefetch_queue_depth=2 keeps; a ParallelSource loop keeps 1 or "
                             "2; holding more costs a batch of memory each)")
    return parser


def main(argv: List[str]) -> int:
    args = _parser().parse_args(argv)
    prefetch = default_prefetch(args.workers) if args.prefetch is None else args.prefetch
    problems: List[str] = []
    notes: List[str] = []
    fmt = limits.format_bytes

    print(f"extsrc {extsrc.__version__}, Python {platform.python_version()}, NumPy {np.__version__}, "
          f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs")
    usage = limits.dev_shm_usage()
    if usage is None:
        print("/dev/shm: not mounted")
    else:
        print(f"/dev/shm: {fmt(usage[0])} in all, {fmt(usage[1])} free")
    print(f"memfd: {_check_memfd()}")
    backend = shm_backend()
    print(f"shared-memory backend in force: {backend}")
    if streaming.available():
        print(f"large samples (>= {fmt(streaming.STREAM_MIN_BYTES)}): copied past the caches")
    else:
        print(f"large samples: copied with NumPy ({streaming.why_not()})")
    found = limits.memory_limits()
    for limit in found:
        print(f"memory limit: {limit.describe()}, {fmt(limit.room)} left")

    need = needed_bytes(args.workers, args.batch_size, args.sample_bytes, args.outputs,
                        prefetch, args.batches_held)
    print(f"\nsettings: {args.workers} workers, batch {args.batch_size}, {args.outputs} output(s) of "
          f"{fmt(args.sample_bytes)} per sample, prefetch {prefetch}, batches held "
          f"{args.batches_held}\n  shared memory needed per source: about {fmt(need)}")
    tightest = limits.tightest(found)
    if tightest is not None and need + limits.HEADROOM > tightest.room:
        problems.append(
            f"these settings need about {fmt(need)} of memory, and {tightest.describe()} leaves "
            f"{fmt(tightest.room)}: extsrc would refuse them with SharedMemoryError. Lower the "
            "prefetch, the batch size or the batches held"
            + (", or raise the container's memory limit" if "cgroup" in tightest.name else "")
        )
    if backend == "devshm" and usage is not None and need > usage[1]:
        problems.append(
            f"/dev/shm has {fmt(usage[1])} free but these settings need {fmt(need)}: start the "
            f"container with {limits.shm_size_advice(need)}, or unset EXTSRC_SHM_BACKEND to use memfd"
        )
    if backend == "memfd" and usage is not None and usage[0] < (256 << 20):
        notes.append(
            f"/dev/shm is small ({fmt(usage[0])}; Docker's default is 64 MiB). extsrc is not "
            "affected (memfd), but DALI's own parallel source and PyTorch's DataLoader are: "
            f"for them give the container {limits.shm_size_advice(need)} or more"
        )

    print("\nstart methods:")
    for method in START_METHODS:
        result = _check_start_method(method)
        print(f"  {method:<11} {result}")
        if result.startswith("FAILS"):
            problems.append(f"start_method={method!r} does not work here: {result[7:]}")

    print("\nGPU stage:")
    print(f"  {_cuda_devices()}")
    for label, module in (("DALI", "nvidia.dali"), ("CuPy", "cupy"), ("PyTorch", "torch"),
                          ("dill", "dill")):
        version = _version_of(module)
        print(f"  {label:<8} {version or 'not installed'}")
        if label == "DALI" and version is None:
            notes.append('DALI is not installed: pip install "extsrc[dali]" for extsrc.fn/pipeline_def')

    if problems:
        print("\nproblems:")
        for line in problems:
            print(f"  - {line}")
    if notes:
        print("\nnotes:")
        for line in notes:
            print(f"  - {line}")
    if not problems:
        print("\nno problems found")
    return 1 if problems else 0
