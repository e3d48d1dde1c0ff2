"""``python -m extsrc bench --remote``: loading that waits on storage, from an HTTP object server.

The object server (:mod:`benchmarks.object_server`) runs in its own
process on loopback, started by the bench for each row:

* **latency**: 100 KiB objects, 20 ms to first byte, no bandwidth cap: a
  loader is as fast as the requests it keeps in flight;
* **bandwidth**: 1 MiB objects, 20 ms to first byte, each connection capped
  (:data:`BANDWIDTH_PER_CONNECTION`): a loader needs many connections at once
  to fill the link.

Batch 64, fork. Loaders (each cell in a fresh process, checking that the
last batch holds the right objects): extsrc with 2 workers (an ``async def``
callback with ``concurrency=64``, and a blocking one on threads), extsrc's
DALI drop-in with the async callback, PyTorch's DataLoader with 2 and 32
workers (a ``Dataset`` whose ``__getitem__`` blocks on the request), DALI's
parallel external source with 2 workers (the blocking callback), and the
server's ceiling: a plain aiohttp client in one process keeping
:data:`CEILING_IN_FLIGHT` requests in flight, no loader at all. Figures:
samples/s, MB/s, cores used by the loader's processes, and their memory
(PSS: shared pages split among the processes sharing them, so a sum is
fair), measured at the end of the timed window.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.cells import MB, run_cell
from benchmarks.packages import installed, version

KIB, MIB = 1 << 10, 1 << 20
BATCH = 64
WORKERS = 2
MANY_WORKERS = 32  # the DataLoader users run instead: many processes, each waiting
CONCURRENCY = 64  # extsrc: samples in flight per worker (one batch per worker at once)
THREADS = 32  # extsrc with a blocking callback: threads per worker (the GIL's share stays small)
CEILING_IN_FLIGHT = WORKERS * CONCURRENCY  # the ceiling client keeps as many requests in flight
TTFB_S = 0.020
BANDWIDTH_PER_CONNECTION = 20 * MIB  # bytes/s per connection on the bandwidth row
# A server just started answers its first seconds slower (its allocator and the pages it sends
# from are being faulted in: the first cell of the bandwidth row ran at ~0.7 of the same loader's
# later cells), so each row starts with this long of the ceiling client, not timed.
SERVER_WARMUP_S = 4.0


@dataclass(frozen=True)
class RemoteRow:
    key: str
    size: int
    ttfb_s: float
    bandwidth: float  # bytes/s per connection, 0: none

    def describe(self) -> str:
        size = f"{self.size // MIB} MiB" if self.size >= MIB else f"{self.size // KIB} KiB"
        cap = (f", {self.bandwidth / MIB:g} MiB/s per connection" if self.bandwidth else "")
        return f"{size} objects, {self.ttfb_s * 1e3:g} ms to first byte{cap}, batch {BATCH}"


ROWS = (RemoteRow("latency", 100 * KIB, TTFB_S, 0.0),
        RemoteRow("bandwidth", MIB, TTFB_S, BANDWIDTH_PER_CONNECTION))

CEILING, EXTSRC_ASYNC, EXTSRC_THREADS, EXTSRC_DALI = "ceiling", "extsrc-async", "extsrc-threads", "extsrc-dali"
TORCH_2, TORCH_MANY, DALI = "torch-2", f"torch-{MANY_WORKERS}", "dali"
NAMES = {
    EXTSRC_ASYNC: f"extsrc.ParallelSource, {WORKERS} workers, async def, concurrency={CONCURRENCY}",
    EXTSRC_THREADS: f"extsrc.ParallelSource, {WORKERS} workers, blocking callback, concurrency={THREADS} (threads)",
    EXTSRC_DALI: f"extsrc drop-in fn.external_source, {WORKERS} workers, async def, concurrency={CONCURRENCY}",
    DALI: f"DALI parallel external source, {WORKERS} workers",
    TORCH_2: f"PyTorch DataLoader, {WORKERS} workers",
    TORCH_MANY: f"PyTorch DataLoader, {MANY_WORKERS} workers",
    CEILING: f"server ceiling: plain aiohttp client, one process, {CEILING_IN_FLIGHT} in flight",
}
LOADERS = (EXTSRC_ASYNC, EXTSRC_THREADS, EXTSRC_DALI, DALI, TORCH_2, TORCH_MANY, CEILING)
TARGETS_TEXT = (
    "  remote (latency row): extsrc 2 workers async >= 20x DataLoader 2 workers, >= 1x DataLoader "
    "32 workers, >= 0.8 of the server's ceiling, less memory than DataLoader 32 workers\n"
    "  remote (bandwidth row): extsrc 2 workers async >= 0.8 of the server's ceiling (the link)\n"
    "  remote: the drop-in >= 0.9 of extsrc.ParallelSource"
)


# -- inside a cell's process --------------------------------------------------------------------


class _HttpDataset:
    """A map-style dataset whose ``__getitem__`` blocks on the object's request."""

    def __init__(self, url: str, size: int):
        from benchmarks.remote_clients import BlockingHttpObjects

        self.get = BlockingHttpObjects(url, size=size)

    def __len__(self) -> int:
        return 10 ** 9

    def __getitem__(self, index: int) -> Any:
        from extsrc.sample_info import SampleInfo

        return self.get(SampleInfo(index, 0, 0, 0))


def _open(loader: str, url: str, size: int) -> Tuple[Any, Any, Any]:
    """``(take, first sample of a batch as bytes, close)``."""
    import numpy as np

    from benchmarks.remote_clients import AsyncHttpObjects, BlockingHttpObjects

    if loader in (EXTSRC_ASYNC, EXTSRC_THREADS):
        import extsrc

        async_ = loader == EXTSRC_ASYNC
        callback = AsyncHttpObjects(url, size=size) if async_ else BlockingHttpObjects(url, size=size)
        source = extsrc.ParallelSource(callback, BATCH, num_workers=WORKERS,
                                       concurrency=CONCURRENCY if async_ else THREADS)
        batches = iter(source)
        return (lambda: next(batches)), (lambda b: np.asarray(b[0])), source.close
    if loader in (TORCH_2, TORCH_MANY):
        from torch.utils.data import DataLoader

        workers = WORKERS if loader == TORCH_2 else MANY_WORKERS
        data = DataLoader(_HttpDataset(url, size), batch_size=BATCH, num_workers=workers,
                          persistent_workers=True, multiprocessing_context="fork")
        state = {"batches": iter(data)}
        return (lambda: next(state["batches"])), (lambda b: b[0].numpy()), state.clear
    if loader in (DALI, EXTSRC_DALI):
        if loader == DALI:
            from nvidia.dali import fn, pipeline_def
            extra: Dict[str, Any] = {}
            callback = BlockingHttpObjects(url, size=size)
        else:
            from extsrc import fn, pipeline_def
            extra = {"concurrency": CONCURRENCY}
            callback = AsyncHttpObjects(url, size=size)

        @pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, py_num_workers=WORKERS,
                      py_start_method="fork")
        def pipeline():
            return fn.external_source(source=callback, batch=False, parallel=True, **extra)

        pipe = pipeline()
        pipe.build()
        state = {"pipe": pipe}
        return (lambda: state["pipe"].run()[0]), (lambda b: np.asarray(b[0])), state.clear
    raise ValueError(f"unknown loader {loader!r}")


def _ceiling(url: str, size: int, seconds: float, warmup_s: float) -> Dict[str, Any]:
    """The server's own rate: requests from one process, ``CEILING_IN_FLIGHT`` at once."""
    import asyncio

    import numpy as np

    from benchmarks.measure import CpuMeter
    from benchmarks.object_server import object_bytes
    from benchmarks.remote_clients import AsyncHttpObjects
    from extsrc.sample_info import SampleInfo

    get = AsyncHttpObjects(url, size=size)

    async def main() -> Dict[str, Any]:
        counter = {"n": 0}
        first = await get(SampleInfo(0, 0, 0, 0))
        if not np.array_equal(first, object_bytes(0, size)):
            raise RuntimeError("object 0 came back with other bytes")

        async def client(k: int, until: float) -> None:
            index = k
            while time.perf_counter() < until:
                await get(SampleInfo(index, 0, 0, 0))
                counter["n"] += 1
                index += CEILING_IN_FLIGHT

        warm = time.perf_counter() + warmup_s
        await asyncio.gather(*(client(k, warm) for k in range(CEILING_IN_FLIGHT)))
        counter["n"] = 0
        meter = CpuMeter()
        begin = time.perf_counter()
        await asyncio.gather(*(client(k, begin + seconds) for k in range(CEILING_IN_FLIGHT)))
        elapsed = time.perf_counter() - begin
        cpu = meter.stop()
        memory = _tree_pss(os.getpid())
        await get.aclose()
        return {"samples_per_s": counter["n"] / elapsed, "elapsed_s": elapsed, "pss_bytes": memory, **cpu}

    return asyncio.run(main())


def _tree_pss(root: int) -> int:
    """The PSS of ``root`` and its descendants, in bytes."""
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    stack += [int(child) for child in f.read().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def remote_cell(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One loader on one row, in this (fresh) process: its figures."""
    import numpy as np

    from benchmarks.measure import measure
    from benchmarks.object_server import object_bytes

    loader, url, size = spec["loader"], spec["url"], spec["size"]
    if loader == CEILING:
        result = _ceiling(url, size, spec["seconds"], spec["warmup_s"])
    else:
        take, first_of, close = _open(loader, url, size)
        try:
            batches, elapsed, cpu, total, last = measure(take, spec["seconds"], spec["warmup_s"],
                                                         warmup_batches=1)
            memory = _tree_pss(os.getpid())
            got = first_of(last)
            if not np.array_equal(got, object_bytes((total - 1) * BATCH, size)):
                raise RuntimeError(f"{loader}: batch {total - 1} does not start with object "
                                   f"{(total - 1) * BATCH}")
        finally:
            close()
        cpu.pop("faults", None)
        result = {"samples_per_s": batches * BATCH / elapsed, "elapsed_s": elapsed,
                  "pss_bytes": memory, **cpu}
    result["mb_per_s"] = result["samples_per_s"] * size / MB
    return result


# -- the bench's process ------------------------------------------------------------------------


def run(args: argparse.Namespace, seconds: float, warmup_s: float, repeat: int) -> int:
    """Runs the ``--remote`` tables; 0 when every cell ran, 1 when one failed, 2 when it cannot."""
    from benchmarks.object_server import ObjectServer

    if not installed("aiohttp"):
        print("extsrc bench: --remote needs aiohttp (pip install 'extsrc[remote]')", file=sys.stderr)
        return 2
    if getattr(args, "plot", None) and not installed("matplotlib"):
        print("extsrc bench: --plot needs matplotlib (pip install 'extsrc[bench]')", file=sys.stderr)
        return 2
    loaders = [loader for loader in LOADERS
               if not (loader in (TORCH_2, TORCH_MANY) and not installed("torch"))
               and not (loader in (DALI, EXTSRC_DALI) and not installed("nvidia.dali"))]
    runs: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    failures: List[str] = []
    load_start = os.getloadavg()
    for row in ROWS:
        with ObjectServer(size=row.size, ttfb_s=row.ttfb_s, bandwidth=row.bandwidth) as server:
            run_cell({"kind": "remote", "loader": CEILING, "url": server.url, "size": row.size,
                      "seconds": SERVER_WARMUP_S, "warmup_s": 0.0}, args.timeout)  # not timed
            plan = [loader for r in range(repeat)
                    for loader in (loaders if r % 2 == 0 else list(reversed(loaders)))]
            print(f"extsrc bench --remote, {row.key} row ({row.describe()}): {len(plan)} cells, "
                  f"{seconds:g} s timed + {warmup_s:g} s warm-up each", file=sys.stderr)
            for n, loader in enumerate(plan, 1):
                spec = {"kind": "remote", "loader": loader, "url": server.url, "size": row.size,
                        "seconds": seconds, "warmup_s": warmup_s}
                result = run_cell(spec, args.timeout)
                if "error" in result:
                    failures.append(f"{row.key}, {NAMES[loader]}: {result['error']}")
                    print(f"  [{n}/{len(plan)}] {NAMES[loader]}: FAILED ({result['error']})",
                          file=sys.stderr)
                    continue
                runs.setdefault((row.key, loader), []).append(result)
                print(f"  [{n}/{len(plan)}] {NAMES[loader]}: {result['samples_per_s']:,.0f} samples/s",
                      file=sys.stderr)
    print(f"\nPython {sys.version.split()[0]}, {os.cpu_count()} CPUs, torch {version('torch')}, "
          f"DALI {version('nvidia-dali-cuda120')}, aiohttp {version('aiohttp')}; load average "
          f"{load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    print(f"Median of {repeat} run(s) per cell, {seconds:g} s timed after {warmup_s:g} s warm-up; "
          "the object server in its own process on loopback (its CPU is not counted).\n")
    for row in ROWS:
        print(table(row, runs))
        print()
    print("targets:\n" + TARGETS_TEXT)
    if getattr(args, "plot", None):
        chart(args.plot, runs, load_start[0], os.getloadavg()[0])
        print(f"\nplot: {os.path.abspath(args.plot)}")
    if getattr(args, "json", None):
        import json

        with open(args.json, "w") as f:
            json.dump({f"{row}/{loader}": results for (row, loader), results in runs.items()}, f, indent=1)
    for failure in failures:
        print(f"  failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


def chart(path: str, runs: Dict[Tuple[str, str], List[Dict[str, Any]]], load_start: float,
          load_end: float) -> None:
    """Draws the rows' samples/s to ``path`` (PNG, SVG, ...: the suffix decides); needs matplotlib."""
    from benchmarks.plot import remote_chart

    panels = [(f"{row.key}: {row.describe()}",
               [(loader, NAMES[loader], _median(runs, row.key, loader, "samples_per_s"))
                for loader in LOADERS]) for row in ROWS]
    title = (f"extsrc bench --remote on {os.cpu_count()} CPUs (load average {load_start:.1f} at "
             f"start, {load_end:.1f} at end); dashed: the server's ceiling")
    remote_chart(path, title, panels, EXTSRC_ASYNC, CEILING)


def _median(runs: Dict[Tuple[str, str], List[Dict[str, Any]]], row: str, loader: str,
            field: str) -> Optional[float]:
    values = [r[field] for r in runs.get((row, loader), []) if field in r]
    return statistics.median(values) if values else None


def table(row: RemoteRow, runs: Dict[Tuple[str, str], List[Dict[str, Any]]]) -> str:
    """The markdown table of one row: medians, and extsrc (async) / each other loader."""
    reference = _median(runs, row.key, EXTSRC_ASYNC, "samples_per_s")
    lines = [f"{row.key}: {row.describe()}, fork:",
             "| loader | samples/s | MB/s | cores used | memory (PSS) | extsrc async / this |",
             "|---|---|---|---|---|---|"]
    for loader in LOADERS:
        rate = _median(runs, row.key, loader, "samples_per_s")
        if rate is None:
            lines.append(f"| {NAMES[loader]} | n/a | | | | |")
            continue
        mb = _median(runs, row.key, loader, "mb_per_s") or 0.0
        cores = _median(runs, row.key, loader, "loader_cpu")
        pss = _median(runs, row.key, loader, "pss_bytes")
        ratio = ("1.00x (reference)" if loader == EXTSRC_ASYNC
                 else "n/a" if reference is None else f"{reference / rate:.2f}x")
        lines.append(f"| {NAMES[loader]} | {rate:,.0f} | {mb:,.0f} | "
                     f"{'' if cores is None else f'{cores:.2f}'} | "
                     f"{'' if pss is None else f'{pss / MIB:,.0f} MiB'} | {ratio} |")
    ceiling = _median(runs, row.key, CEILING, "samples_per_s")
    dropin = _median(runs, row.key, EXTSRC_DALI, "samples_per_s")
    notes = []
    if reference is not None and ceiling:
        notes.append(f"extsrc async at {reference / ceiling:.2f} of the server's ceiling")
    if reference is not None and dropin:
        notes.append(f"drop-in at {dropin / reference:.2f} of the engine")
    if notes:
        lines.append("\n" + "; ".join(notes) + ".")
    return "\n".join(lines)
