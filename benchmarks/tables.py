"""What the bench compares, what each row must reach, and how results are shown.

A :class:`Table` is one comparison (extsrc against a peer, or one extsrc
setting against another); each :class:`Row` is one workload with a
:class:`Target`. A row's figures are medians of its usable runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.loaders import (
    DALI, DALI_THREADS, EXTSRC, EXTSRC_DALI, EXTSRC_FROM_DATASET, EXTSRC_FROM_DATASET_COLLATE,
    EXTSRC_FROM_DATASET_INLINE, EXTSRC_FROM_DATASET_ITERABLE, EXTSRC_IDENTITY, EXTSRC_NO_STATS,
    EXTSRC_SHUFFLED, ORDER_RECORDS, READY, STARTUP_WORKERS, STEP_CPU_S, TORCH, TORCH_COLLATE,
    TORCH_INLINE, TORCH_ITERABLE, WORKERS,
)
from benchmarks.workloads import ALL_WORKLOADS, WORKLOADS

QUIET_OTHER_CPU = 0.25  # cores other processes may use during a run that counts as undisturbed

@dataclass(frozen=True)
class Target:
    """``metric`` of extsrc must reach ``value``: a ratio to the peer, or a fraction of ideal."""

    metric: str  # "samples_per_s" | "mb_per_s" | "steps_per_s" | "ideal_fraction" | "startup_s" | "extra_bytes"
    value: float

    def describe(self) -> str:
        if self.metric == "extra_bytes":
            return f"< {self.value / (1 << 20):g} MiB more"
        if self.metric == "ideal_fraction":
            return f">= {self.value:g} of ideal"
        if self.metric == "startup_s":
            return "no slower" if self.value == 1.0 else f">= {self.value:g}x faster"
        unit = {"samples_per_s": "samples/s", "steps_per_s": "steps/s"}.get(self.metric, "MB/s")
        return f">= {self.value:g}x {unit}"

@dataclass(frozen=True)
class Row:
    """One line of a table: extsrc's loader and its peer on one workload."""

    label: str
    workload: str
    ours: str  # loader name of extsrc's cell
    peer: str  # loader name of the peer's cell
    target: Target
    kind: str = "throughput"  # or "startup" (time to the first batch), "memory" (workers' memory),
    # "step" (steps/s of a training step per batch, benchmarks.step)
    consumed: bool = False  # DALI rows: the pipeline slices the source output instead of returning it
    faults: bool = False  # show minor page faults per sample; with no_more_faults, extsrc's must be
    no_more_faults: bool = False  # at most the peer's for the target to be met

    @property
    def startup(self) -> bool:
        return self.kind == "startup"

@dataclass
class Table:
    """One comparison: its rows, and a note when the peer cannot run here."""

    key: str
    title: str
    ours_name: str
    peer_name: str
    rows: List[Row] = field(default_factory=list)
    note: Optional[str] = None  # why the peer column is missing, if it is

def workload_label(name: str) -> str:
    """The first cell of a workload's row, e.g. ``small: 1 KiB uint8, batch 256``."""
    w = ALL_WORKLOADS[name]
    if w.spin_s:
        return f"{name}: {w.spin_s * 1e3:g} ms busy loop, batch {w.batch_size}"
    size = f"{w.sample_bytes >> 20} MiB" if w.sample_bytes >= 1 << 20 else f"{w.sample_bytes >> 10} KiB"
    return f"{name}: {size} uint8, batch {w.batch_size}"

_FRESH = "large-fresh: a new 4 MiB array per sample"
_FILL = "large-fill: 4 MiB written by the callback (in place: extsrc's in_place=True)"
_SMALL_FRESH = "small-fresh: a new 1 KiB array per sample, batch 256"
_RAGGED = "ragged: a new array of 256 B to 1.75 KiB per sample, batch 256"
_SHAPED = {"tensor": "tensor: a new 3x32x32 float32 tensor per sample",
           "dict": "dict: {image: a new 3x32x32 float32 tensor, label: int}"}


def torch_table() -> Table:
    """extsrc.ParallelSource vs torch.utils.data.DataLoader."""
    table = Table(TORCH, f"extsrc.ParallelSource vs PyTorch DataLoader ({WORKERS} workers, fork)",
                  "extsrc", "DataLoader")
    targets = {  # the floors the engine keeps (its first targets were 2x and 3x)
        "small": Target("samples_per_s", 4.0),
        "large": Target("mb_per_s", 4.0),
        "cpu": Target("ideal_fraction", 0.95),
    }
    table.rows = [Row(workload_label(w), w, EXTSRC, TORCH, targets[w]) for w in WORKLOADS]
    table.rows.append(Row(f"{_FILL}, batch 16", "large-fill", EXTSRC, TORCH, Target("mb_per_s", 3.0),
                          faults=True))
    # Samples of changing sizes: 0.7x the DataLoader before the worker wrote each without making an
    # array over shared memory for it and sent its place as a plain tuple; 1.4-1.8x since.
    table.rows.append(Row(f"{_RAGGED} (DataLoader: a collate_fn keeping the list)", "ragged", EXTSRC,
                          TORCH, Target("samples_per_s", 1.3)))
    return table

def from_dataset_table() -> Table:
    """extsrc.torch.from_dataset vs torch.utils.data.DataLoader, on the same Dataset."""
    table = Table("from_dataset", f"extsrc.torch.from_dataset vs PyTorch DataLoader, same Dataset "
                  f"({WORKERS} workers, fork)", "from_dataset", "DataLoader")
    targets = {
        "small": Target("samples_per_s", 3.0),
        "large": Target("mb_per_s", 3.0),
        "cpu": Target("ideal_fraction", 0.95),
    }
    table.rows = [Row(workload_label(w), w, EXTSRC_FROM_DATASET, TORCH, targets[w]) for w in WORKLOADS]
    # A user's collate_fn (run in the worker, its tensor carried in shared memory), and a stream.
    unit = {"small": "samples_per_s", "large": "mb_per_s"}
    table.rows += [Row(f"{workload_label(w)}, collate_fn=stack", w, EXTSRC_FROM_DATASET_COLLATE, TORCH_COLLATE,
                       Target(unit[w], 1.5)) for w in ("small", "large")]
    table.rows += [Row(f"{workload_label(w)}, IterableDataset", w, EXTSRC_FROM_DATASET_ITERABLE, TORCH_ITERABLE,
                       Target(unit[w], 1.5)) for w in ("small", "large")]
    # What PyTorch datasets return, with and without workers.
    table.rows += [Row(f"{_SHAPED[w]}, batch 128, epochs of 32 batches", w, EXTSRC_FROM_DATASET, TORCH,
                       Target("samples_per_s", 1.5)) for w in ("tensor", "dict")]
    table.rows.append(Row(f"{_SHAPED['dict']}, batch 128, a collate_fn calling default_collate", "dict",
                          EXTSRC_FROM_DATASET_COLLATE, TORCH_COLLATE, Target("samples_per_s", 1.5)))
    table.rows += [Row(f"{_SHAPED[w]}, batch 128, num_workers=0", w, EXTSRC_FROM_DATASET_INLINE,
                       TORCH_INLINE, Target("samples_per_s", 1.0)) for w in ("tensor", "dict")]
    return table

def dali_table() -> Table:
    """extsrc's DALI drop-in vs DALI's own parallel external source."""
    table = Table(DALI, f"extsrc drop-in vs DALI parallel external source ({WORKERS} workers, fork, "
                  f"num_threads={DALI_THREADS})",
                  "extsrc drop-in", "DALI")
    targets = {
        "small": Target("samples_per_s", 3.0),
        "large": Target("mb_per_s", 2.0),
        "cpu": Target("samples_per_s", 1.0),
    }
    table.rows = [Row(workload_label(w), w, EXTSRC_DALI, DALI, targets[w]) for w in WORKLOADS]
    # Returning the source output makes DALI copy every batch into its output buffers; a
    # real pipeline feeds the source to an operator (a decoder), which this row stands for.
    table.rows.append(Row(f"{workload_label('large')}, output sliced to 8 bytes (no output copy)", "large",
                          EXTSRC_DALI, DALI, Target("mb_per_s", 2.0), consumed=True))
    table.rows.append(Row(f"{_FRESH}, batch 16, output sliced", "large-fresh", EXTSRC_DALI, DALI,
                          Target("samples_per_s", 1.3), consumed=True, faults=True,
                          no_more_faults=True))
    table.rows.append(Row(f"{_FILL}, batch 16, output sliced", "large-fill", EXTSRC_DALI, DALI,
                          Target("mb_per_s", 2.0), consumed=True, faults=True))
    # Both feed DALI a list of arrays, sample by sample (about 4.4 ms of the consumer's CPU per
    # batch either way): no slower than DALI is the floor (0.85x before, 1.1-1.2x since).
    table.rows.append(Row(_RAGGED, "ragged", EXTSRC_DALI, DALI, Target("samples_per_s", 1.0)))
    table.rows.append(Row(f"build() to first batch, spawn, {STARTUP_WORKERS} workers", "small",
                          EXTSRC_DALI, DALI, Target("startup_s", 1.0), kind="startup"))
    return table

def dropin_engine_table(torch: bool = False) -> Table:
    """extsrc's layers with their defaults (the DALI drop-in with DALI's default arguments;
    ``from_dataset`` with DataLoader's, when PyTorch is installed) against the engine under
    them, the same callback: what each layer costs the consumer."""
    table = Table("dropin-engine", f"extsrc layers vs extsrc.ParallelSource under them ({WORKERS} workers, "
                  f"fork; the drop-in with num_threads={DALI_THREADS} and DALI's default "
                  "prefetch_queue_depth, from_dataset with DataLoader's defaults)",
                  "the layer", "ParallelSource")
    table.rows = [
        Row(f"drop-in, {_SMALL_FRESH}", "small-fresh", EXTSRC_DALI, EXTSRC, Target("samples_per_s", 0.8)),
        Row(f"drop-in, {workload_label('small')}", "small", EXTSRC_DALI, EXTSRC, Target("samples_per_s", 0.8)),
    ]
    if torch:
        table.rows.append(Row(f"from_dataset, the same samples from a map-style Dataset, {_SMALL_FRESH}",
                              "small-fresh", EXTSRC_FROM_DATASET, EXTSRC, Target("samples_per_s", 0.8)))
    return table


def training_step_table(torch: bool, dali: bool) -> Table:
    """Steps/s of a CPU-bound training step per batch, with each loader against ready batches."""
    step_ms = STEP_CPU_S * 1e3
    table = Table("step", f"training step: {step_ms:g} ms of one thread's CPU per batch, {_SMALL_FRESH}, "
                  f"{WORKERS} workers, fork; steps/s with each loader against ready batches (no loader)",
                  "with the loader", "ready batches")
    loaders = [("extsrc.ParallelSource", EXTSRC)]
    if dali:
        loaders.append((f"extsrc drop-in (num_threads={DALI_THREADS})", EXTSRC_DALI))
    if torch:
        loaders.append(("PyTorch DataLoader", TORCH))
    table.rows = [Row(name, "small-fresh", loader, READY, Target("steps_per_s", 0.9), kind="step")
                  for name, loader in loaders]
    return table


def features_table() -> Table:
    """What extsrc's own features cost: statistics, a shuffled order, and the order's memory."""
    table = Table("features", f"cost of extsrc features ({WORKERS} workers, fork)", "with", "without")
    table.rows = [
        Row(f"{workload_label('small')}: statistics on vs off", "small", EXTSRC, EXTSRC_NO_STATS,
            Target("samples_per_s", 0.98)),
        Row(f"{workload_label('small')}: shuffled order of {ORDER_RECORDS:.0e} records vs identity order",
            "small", EXTSRC_SHUFFLED, EXTSRC_IDENTITY, Target("samples_per_s", 0.95)),
        Row(f"worker memory (VmRSS): shuffled order of {ORDER_RECORDS:.0e} records vs identity order",
            "small", EXTSRC_SHUFFLED, EXTSRC_IDENTITY, Target("extra_bytes", 1 << 20), kind="memory"),
    ]
    return table


def _median(runs: List[Dict[str, Any]], key: str) -> Optional[float]:
    values = [run[key] for run in runs if key in run]
    return statistics.median(values) if values else None

def _usable(runs: List[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], bool]:
    """The runs a figure is made of, and whether they were all disturbed.

    Runs during which other processes used more than ``QUIET_OTHER_CPU`` cores
    are left out, unless no run was quieter (then all count, and the figure
    is marked as disturbed).
    """
    ok = [run for run in runs if "error" not in run]
    quiet = [run for run in ok if run.get("other_cpu", 0.0) <= QUIET_OTHER_CPU]
    return (quiet, False) if quiet else (ok, bool(ok))

def figure(row: Row, runs: List[Dict[str, Any]]) -> str:
    """One loader's cell of the printed table (``*``: every run was disturbed)."""
    if not runs:
        return "n/a"
    runs, disturbed = _usable(runs)
    if not runs:
        return "error"
    mark = " *" if disturbed else ""
    if row.kind == "memory":
        return f"{_median(runs, 'worker_rss_bytes') / (1 << 20):,.1f} MiB{mark}"
    if row.kind == "step":
        return f"{_median(runs, 'steps_per_s'):,.0f} steps/s{mark}"
    if row.startup:
        return f"{_median(runs, 'startup_s'):.2f} s{mark}"
    w = ALL_WORKLOADS[row.workload]
    rate = _median(runs, "samples_per_s")
    shares = runs[0].get("node_shares")  # Ray on several nodes: each node's share of the samples
    if shares:
        mark = f", nodes {' / '.join(f'{s:.0%}' for s in shares)}{mark}"
    consumer = _median(runs, "consumer_ms_per_batch")
    cpu = "" if consumer is None else f"; consumer {consumer:.2f} ms CPU/batch"
    if w.spin_s:
        return f"{rate:,.0f} samples/s ({_median(runs, 'ideal_fraction'):.2f} of ideal){cpu}{mark}"
    faults = ""
    if row.faults and _median(runs, "faults_per_sample") is not None:
        faults = f", {_median(runs, 'faults_per_sample'):,.0f} faults/sample"
    if w.sample_bytes >= 1 << 20:
        return f"{_median(runs, 'mb_per_s'):,.0f} MB/s ({rate:,.0f} samples/s{faults}){cpu}{mark}"
    return f"{rate / 1e3:,.1f}k samples/s{cpu}{mark}"

def compare(row: Row, ours: List[Dict[str, Any]], peer: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The ratio of a row and whether its target is met (None where it cannot be told)."""
    ours_ok, ours_disturbed = _usable(ours)
    peer_ok, peer_disturbed = _usable(peer)
    ratio = None
    if row.kind == "memory":
        extra = (_median(ours_ok, "worker_rss_bytes") - _median(peer_ok, "worker_rss_bytes")
                 if ours_ok and peer_ok else None)
        return {"ratio": None, "achieved": extra, "met": None if extra is None else extra < row.target.value,
                "disturbed": ours_disturbed or peer_disturbed}
    if row.startup:
        if ours_ok and peer_ok:
            ratio = _median(peer_ok, "startup_s") / _median(ours_ok, "startup_s")
    elif ours_ok and peer_ok:
        key = row.target.metric if row.target.metric in ("mb_per_s", "steps_per_s") else "samples_per_s"
        ratio = _median(ours_ok, key) / _median(peer_ok, key)
    if row.target.metric == "ideal_fraction":
        achieved = _median(ours_ok, "ideal_fraction") if ours_ok else None
    else:
        achieved = ratio
    met = None if achieved is None else achieved >= row.target.value
    if met and row.no_more_faults:
        ours_faults, peer_faults = _median(ours_ok, "faults_per_sample"), _median(peer_ok, "faults_per_sample")
        if ours_faults is not None and peer_faults is not None:
            met = ours_faults <= peer_faults
    return {"ratio": ratio, "achieved": achieved, "met": met,
            "disturbed": ours_disturbed or peer_disturbed}

def format_table(table: Table, results: Dict[Tuple[str, int, str], List[Dict[str, Any]]]) -> str:
    """The Markdown table of one comparison."""
    lines = [f"| workload | {table.ours_name} | {table.peer_name} | ratio | target | met |",
             "|---|---|---|---|---|---|"]
    for i, row in enumerate(table.rows):
        ours = results.get((table.key, i, row.ours), [])
        peer = results.get((table.key, i, row.peer), [])
        verdict = compare(row, ours, peer)
        ratio = "n/a" if verdict["ratio"] is None else f"{verdict['ratio']:.2f}x"
        target = row.target.describe() + (", faults <= peer's" if row.no_more_faults else "")
        if row.kind == "memory" and verdict["achieved"] is not None:
            ratio = f"{verdict['achieved'] / (1 << 20):+.2f} MiB"
        if row.target.metric == "ideal_fraction" and verdict["achieved"] is not None:
            target += f" (is {verdict['achieved']:.2f})"
        met = {True: "yes", False: "no", None: "n/a"}[verdict["met"]]
        cells = (row.label, figure(row, ours), figure(row, peer), ratio, target, met)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

def targets_text(tables: List[Table]) -> str:
    """The targets of ``tables``, for ``--help``."""
    lines = ["targets (printed next to the ratios):"]
    for table in tables:
        lines.append(f"  {table.title}:")
        lines += [f"    {row.label}: {row.target.describe()}" for row in table.rows]
    return "\n".join(lines)
