"""``python -m extsrc bench``: extsrc side by side with its peers, on the same callbacks.

Comparisons (each cell of a table is one loader on one workload):

* **vs PyTorch** (default): ``extsrc.ParallelSource`` against
  ``torch.utils.data.DataLoader`` (a map-style ``Dataset``, default collate,
  ``persistent_workers=True``, default prefetch), 2 workers, fork.
* **from_dataset vs DataLoader** (``--torch-api``): ``extsrc.torch.from_dataset``
  on the DataLoader cell's ``Dataset`` and arguments, against that DataLoader.
* **vs DALI** (``--dali``): DALI's own parallel external source against
  extsrc's drop-in, running the same pipeline code
  (``fn.external_source(source=cb, batch=False, parallel=True)`` in a
  ``pipeline_def`` with ``py_num_workers=2``, ``py_start_method="fork"``,
  ``device_id=None``), plus the time from ``build()`` to the first batch with
  spawn and 4 workers; and the drop-in against the ``ParallelSource`` under it
  (the same callback, a fresh 1 KiB array per sample, DALI's default
  arguments).
* **images** (``--images``, instead of the above): JPEGs from disk through
  decoding and augmentation, five loaders in images/s; see
  :mod:`benchmarks.images`.
* **to the GPU** (``--h2d``, instead of the above): batches copied to a GPU in
  GB/s, ``TorchLoader`` page-locked against ``DataLoader(pin_memory=True)``
  and pageable memory; see :mod:`benchmarks.transfer`.

The workloads are in :mod:`benchmarks.workloads`. Every cell runs in a fresh
subprocess (so one loader's workers never share a process with another's),
the loaders of a row alternate, and the table gives the median of
``--repeat`` interleaved runs. Nothing heavy is imported here: PyTorch and
DALI are imported only inside the cells.
"""


from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
import time
from typing import Any, Dict, List, Optional, Tuple

from benchmarks import images, soak, transfer
from benchmarks.cells import run_cell
from benchmarks.packages import installed, version
from benchmarks.loaders import STARTUP_WORKERS, WORKERS
from benchmarks.ray_bench import ray_tables
from benchmarks.tables import (
    QUIET_OTHER_CPU, Row, Table, compare, dali_table, dropin_engine_table, features_table, figure,
    format_table, training_step_table,
    from_dataset_table, targets_text, torch_table,
)
from benchmarks.workloads import ALL_WORKLOADS, WORKLOADS

def _remote_targets() -> str:
    from benchmarks.remote import TARGETS_TEXT

    return TARGETS_TEXT


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m extsrc bench",
        description=textwrap.fill(
            "Measure extsrc side by side with its peers on the same callbacks (in "
            "benchmarks.workloads): small (1 KiB uint8 samples, batch 256), large (4 MiB, "
            "batch 16) and cpu (a 2 ms busy loop per sample, batch 32), 2 workers, fork. "
            "By default: extsrc.ParallelSource vs torch.utils.data.DataLoader (skipped, with "
            "a note, when PyTorch is not installed). Each cell runs in a fresh subprocess; "
            "the two loaders of a row alternate; the table gives medians over --repeat runs "
            "and ratios extsrc/peer (for the startup row: peer time / extsrc time, so above "
            "1 means extsrc is faster). MB = 10^6 bytes; ideal (cpu) = workers x 500 "
            "samples/s. Exit code 0 when every cell ran "
            "(whether or not the targets were met), 1 when a cell failed.",
            79,
        ),
        epilog=targets_text([torch_table(), from_dataset_table(), dali_table(), features_table(),
                             *ray_tables()]) + "\n" + images.targets_text() + "\n" + _remote_targets(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dali", action="store_true",
                        help="also compare extsrc's DALI drop-in (from extsrc import fn, "
                             "pipeline_def) with DALI's own parallel external source on the "
                             "same pipeline code, plus the time from build() to the first "
                             "batch with spawn and 4 workers (needs nvidia-dali)")
    parser.add_argument("--no-torch", action="store_true",
                        help="skip the PyTorch comparison")
    parser.add_argument("--backend", choices=("processes", "ray"), default="processes",
                        help="ray: compare backend='ray' on a local Ray (ray.init(num_cpus=2), 2 "
                             "actors) with worker processes on the three workloads, and run the "
                             "cpu workload on a local two-node cluster (1 CPU, 1 actor per node), "
                             "instead of the PyTorch comparison (needs extsrc[ray])")
    parser.add_argument("--remote", action="store_true",
                        help="instead of the synthetic workloads: objects from an HTTP object "
                             "server on loopback (20 ms to first byte; a row of 100 KiB objects and "
                             "one of 1 MiB objects with a bandwidth cap per connection), extsrc "
                             "with concurrency= against DataLoader (2 and 32 workers), DALI and "
                             "the server's ceiling (needs extsrc[remote])")
    parser.add_argument("--torch-api", action="store_true",
                        help="also compare extsrc.torch.from_dataset with DataLoader on the same "
                             "Dataset and arguments (needs PyTorch)")
    parser.add_argument("--training-step", action="store_true",
                        help="also measure the step rate of a training loop that runs a fixed "
                             "CPU-bound step per batch, with each loader against ready batches")
    parser.add_argument("--features", action="store_true",
                        help="also measure what extsrc's own features cost on the small workload: "
                             "statistics on vs off, a shuffled order of 10^9 records vs an identity "
                             "order, and the workers' memory with that order")
    parser.add_argument("--quick", action="store_true",
                        help="short cells (0.5 s timed after 0.25 s warm-up, 1 repeat unless "
                             "--repeat is given): checks that everything runs, figures are rough")
    parser.add_argument("--seconds", type=float, default=None,
                        help="timed seconds per cell (default 3, --quick 0.5)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="warm-up seconds per cell, not timed (default 1, --quick 0.25)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="interleaved runs of every cell; the table shows medians "
                             "(default 3, --quick 1)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds after which a cell is killed and reported as failed (default 180)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure, run by run, to PATH")
    images.add_arguments(parser)
    transfer.add_arguments(parser)
    soak.add_arguments(parser)
    return parser

def main(argv: Optional[List[str]] = None) -> int:
    """``python -m extsrc bench``; returns the exit code."""
    args = _parser().parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (0.5 if args.quick else 3.0)
    warmup_s = args.warmup if args.warmup is not None else (0.25 if args.quick else 1.0)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads or repeat < 1 or seconds <= 0 or warmup_s < 0:
        problem = (f"unknown workload(s) {unknown}" if unknown else "no workload" if not workloads
                   else "--repeat must be >= 1, --seconds > 0 and --warmup >= 0")
        print(f"extsrc bench: {problem}", file=sys.stderr)
        return 2
    if args.soak is not None:
        return soak.run(args)
    if args.images:
        return images.run(args, seconds, warmup_s, repeat)
    if args.h2d:
        return transfer.run(args, seconds, warmup_s, repeat)
    if args.remote:
        from benchmarks import remote

        return remote.run(args, seconds, warmup_s, repeat)

    tables: List[Table] = []
    if args.backend == "ray":
        if not installed("ray"):
            print("extsrc bench: --backend ray needs Ray (pip install 'extsrc[ray]')", file=sys.stderr)
            return 2
        tables += ray_tables()
    elif not args.no_torch:
        table = torch_table()
        if not installed("torch"):
            table.note = ("PyTorch is not installed: the DataLoader column is skipped "
                          "(pip install 'extsrc[bench]' to compare)")
        tables.append(table)
    if args.dali:
        if not installed("nvidia.dali"):
            print("extsrc bench: --dali needs NVIDIA DALI (pip install 'extsrc[dali]')", file=sys.stderr)
            return 2
        tables.append(dali_table())
        tables.append(dropin_engine_table(torch=installed("torch") and not args.no_torch))
    if args.torch_api:
        if not installed("torch"):
            print("extsrc bench: --torch-api needs PyTorch (pip install 'extsrc[torch]')", file=sys.stderr)
            return 2
        tables.append(from_dataset_table())
    if args.features:
        tables.append(features_table())
    if args.training_step:
        tables.append(training_step_table(torch=installed("torch") and not args.no_torch,
                                          dali=installed("nvidia.dali")))
    if not tables:
        print("extsrc bench: nothing to run (--no-torch without --torch-api, --dali, --features or "
              "--training-step)",
              file=sys.stderr)
        return 2
    for table in tables:
        # "large" also selects its variants ("large-fresh", "large-fill"), "small" the torch-shaped
        table.rows = [r for r in table.rows if ALL_WORKLOADS[r.workload].family in workloads or r.startup]

    plan: List[Tuple[Table, int, Row, str]] = []
    for r in range(repeat):
        for table in tables:
            for i, row in enumerate(table.rows):
                loaders = [row.ours] if table.note else [row.ours, row.peer]
                if (r + i) % 2:
                    loaders.reverse()
                plan += [(table, i, row, loader) for loader in loaders]

    print(f"extsrc bench: {len(plan)} cells ({repeat} x {len(plan) // repeat}), "
          f"{seconds:g} s timed + {warmup_s:g} s warm-up each, every cell in a fresh process",
          file=sys.stderr)
    load_start = os.getloadavg()
    started = time.time()
    results: Dict[Tuple[str, int, str], List[Dict[str, Any]]] = {}
    failures = []
    for n, (table, i, row, loader) in enumerate(plan, 1):
        spec = {"loader": loader, "workload": row.workload, "seconds": seconds,
                "warmup_s": warmup_s, "kind": row.kind, "consumed": row.consumed}
        result = run_cell(spec, args.timeout)
        results.setdefault((table.key, i, loader), []).append(result)
        name = table.ours_name if loader == row.ours else table.peer_name
        if "error" in result:
            failures.append(f"{row.label}, {name}: {result['error']}")
            shown = "FAILED"
        else:
            shown = figure(row, [result]).rstrip(" *")
            if result.get("other_cpu", 0.0) > QUIET_OTHER_CPU:
                shown += f" (disturbed: other processes used {result['other_cpu']:.2f} cores)"
        print(f"  [{n}/{len(plan)}] {row.label} | {name}: {shown}", file=sys.stderr, flush=True)
    load_end = os.getloadavg()

    versions = {name: version(dist) for name, dist in
                (("extsrc", "extsrc"), ("numpy", "numpy"), ("torch", "torch"),
                 ("dali", "nvidia-dali-cuda120"))}
    if args.backend == "ray":
        versions["ray"] = version("ray")
    print()
    print(f"Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
          + f"; load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end")
    print(f"Median of {repeat} interleaved run(s) per cell, {seconds:g} s timed after {warmup_s:g} s "
          "warm-up, each in a fresh process.")
    for table in tables:
        print()
        print(f"{table.title}:")
        if table.note:
            print(table.note)
        print(format_table(table, results))
    disturbed = any(
        compare(row, results.get((t.key, i, row.ours), []),
                 results.get((t.key, i, row.peer), []))["disturbed"]
        for t in tables for i, row in enumerate(t.rows)
    )
    if disturbed:
        print(f"\n* every run of this figure shared the CPUs with other processes (more than "
              f"{QUIET_OTHER_CPU:g} cores on average): it is low; rerun on a quieter machine or with "
              "a larger --repeat.")
    noisy = sum(1 for runs in results.values() for run in runs
                if run.get("other_cpu", 0.0) > QUIET_OTHER_CPU)
    if noisy:
        print(f"{'' if disturbed else chr(10)}{noisy} of {len(plan)} runs were disturbed (other "
              f"processes used more than {QUIET_OTHER_CPU:g} cores); each figure is the median of "
              "its undisturbed runs where it has any.")
    if failures:
        print("\nFailed cells:", file=sys.stderr)
        for failure in failures:
            print(f"  {failure}", file=sys.stderr)

    if args.json:
        report = {
            "settings": {"seconds": seconds, "warmup_s": warmup_s, "repeat": repeat,
                         "workers": WORKERS, "startup_workers": STARTUP_WORKERS,
                         "workloads": workloads},
            "environment": {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "versions": versions, "loadavg_start": load_start,
                            "loadavg_end": load_end, "wall_s": time.time() - started},
            "tables": [],
        }
        for table in tables:
            rows = []
            for i, row in enumerate(table.rows):
                ours = results.get((table.key, i, row.ours), [])
                peer = results.get((table.key, i, row.peer), [])
                rows.append({
                    "label": row.label, "workload": row.workload, "kind": row.kind,
                    "target": {"metric": row.target.metric, "value": row.target.value,
                               "text": row.target.describe()},
                    table.ours_name: ours, table.peer_name: peer,
                    **compare(row, ours, peer),
                })
            report["tables"].append({"key": table.key, "title": table.title,
                                     "ours": table.ours_name, "peer": table.peer_name,
                                     "note": table.note, "rows": rows})
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
