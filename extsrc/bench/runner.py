"""``python -m extsrc bench``: extsrc side by side with its peers, on the same callbacks.

Comparisons (each cell of a table is one loader on one workload):

* **vs PyTorch** (default): ``extsrc.ParallelSource`` against
  ``torch.utils.data.DataLoader`` (a map-style ``Dataset``, default collate,
  ``persistent_workers=True``, default prefetch), 2 workers, fork.
* **vs DALI** (``--dali``): DALI's own parallel external source against
  extsrc's drop-in, running the same pipeline code
  (``fn.external_source(source=cb, batch=False, parallel=True)`` in a
  ``pipeline_def`` with ``py_num_workers=2``, ``py_start_method="fork"``,
  ``device_id=None``), plus the time from ``build()`` to the first batch with
  spawn and 4 workers.

The workloads are in :mod:`extsrc.bench.workloads`. Every cell runs in a fresh
subprocess (so one loader's workers never share a process with another's),
the loaders of a row alternate, and the table gives the median of
``--repeat`` interleaved runs. Nothing heavy is imported here: PyTorch and
DALI are imported only inside the cells.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from extsrc.bench.workloads import WORKLOADS

RESULT_MARK = "EXTSRC-BENCH-RESULT "
WORKERS = 2
STARTUP_WORKERS = 4
DALI_THREADS = 1  # num_threads of the DALI pipelines (DALI requires a value)
MB = 1e6  # MB/s figures are in 10^6 bytes per second
QUIET_OTHER_CPU = 0.25  # cores other processes may use during a run that counts as undisturbed

# Loader names used by the cells.
EXTSRC, TORCH, DALI, EXTSRC_DALI = "extsrc", "torch", "dali", "extsrc-dali"

_CELL_CODE = """\
import sys
from extsrc.bench.runner import _cell_main

if __name__ == "__main__":
    sys.exit(_cell_main(sys.argv[1:]))
"""


# -- what a row compares and what it must reach ----------------------------------------------


@dataclass(frozen=True)
class Target:
    """``metric`` of extsrc must reach ``value``: a ratio to the peer, or a fraction of ideal."""

    metric: str  # "samples_per_s" | "mb_per_s" | "ideal_fraction" | "startup_s"
    value: float

    def describe(self) -> str:
        if self.metric == "ideal_fraction":
            return f">= {self.value:g} of ideal"
        if self.metric == "startup_s":
            return "no slower" if self.value == 1.0 else f">= {self.value:g}x faster"
        unit = "samples/s" if self.metric == "samples_per_s" else "MB/s"
        return f">= {self.value:g}x {unit}"


@dataclass(frozen=True)
class Row:
    """One line of a table: extsrc's loader and its peer on one workload."""

    label: str
    workload: str
    ours: str  # loader name of extsrc's cell
    peer: str  # loader name of the peer's cell
    target: Target
    startup: bool = False  # a time-to-first-batch row rather than a throughput row
    consumed: bool = False  # DALI rows: the pipeline slices the source output instead of returning it


@dataclass
class Table:
    """One comparison: its rows, and a note when the peer cannot run here."""

    key: str
    title: str
    ours_name: str
    peer_name: str
    rows: List[Row] = field(default_factory=list)
    note: Optional[str] = None  # why the peer column is missing, if it is


def _label(name: str) -> str:
    w = WORKLOADS[name]
    if w.spin_s:
        return f"{name}: {w.spin_s * 1e3:g} ms busy loop, batch {w.batch_size}"
    size = f"{w.sample_bytes >> 20} MiB" if w.sample_bytes >= 1 << 20 else f"{w.sample_bytes >> 10} KiB"
    return f"{name}: {size} uint8, batch {w.batch_size}"


def torch_table() -> Table:
    """extsrc.ParallelSource vs torch.utils.data.DataLoader."""
    table = Table(TORCH, f"extsrc.ParallelSource vs PyTorch DataLoader ({WORKERS} workers, fork)",
                  "extsrc", "DataLoader")
    targets = {  # the floors the engine keeps (its first targets were 2x and 3x)
        "small": Target("samples_per_s", 4.0),
        "large": Target("mb_per_s", 4.0),
        "cpu": Target("ideal_fraction", 0.95),
    }
    table.rows = [Row(_label(w), w, EXTSRC, TORCH, targets[w]) for w in WORKLOADS]
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
    table.rows = [Row(_label(w), w, EXTSRC_DALI, DALI, targets[w]) for w in WORKLOADS]
    # Returning the source output makes DALI copy every batch into its output buffers; a
    # real pipeline feeds the source to an operator (a decoder), which this row stands for.
    table.rows.append(Row(f"{_label('large')}, output sliced to 8 bytes (no output copy)", "large",
                          EXTSRC_DALI, DALI, Target("mb_per_s", 2.0), consumed=True))
    table.rows.append(Row(f"build() to first batch, spawn, {STARTUP_WORKERS} workers", "small",
                          EXTSRC_DALI, DALI, Target("startup_s", 1.0), startup=True))
    return table


# -- one cell, in its own subprocess --------------------------------------------------------

Take = Callable[[], Any]


def _open_extsrc(workload: str, workers: int, start_method: str):
    import extsrc
    from extsrc.bench.workloads import CALLBACKS, sample_index

    source = extsrc.ParallelSource(CALLBACKS[workload], WORKLOADS[workload].batch_size,
                                   num_workers=workers, start_method=start_method)
    batches = iter(source)

    def take():
        batch = next(batches)
        batch[0][0]  # the consumer touches one byte
        return batch

    return take, lambda batch: [sample_index(sample) for sample in batch], source.close


def _open_torch(workload: str, workers: int, start_method: str):
    from torch.utils.data import DataLoader, Dataset

    from extsrc.bench.workloads import sample_index

    class BenchDataset(Dataset):
        """What a user writes: a map-style dataset returning one NumPy sample."""

        def __init__(self, name: str):
            self.workload = WORKLOADS[name]

        def __len__(self) -> int:
            return 1 << 40  # never exhausted within a cell

        def __getitem__(self, idx: int):
            return self.workload.make(idx)

    loader = DataLoader(BenchDataset(workload), batch_size=WORKLOADS[workload].batch_size,
                        num_workers=workers, persistent_workers=True,
                        multiprocessing_context=start_method)
    state = {"batches": iter(loader)}

    def take():
        batch = next(state["batches"])
        batch[0, 0]  # the consumer touches one byte
        return batch

    def close():
        state.clear()  # the iterator's finaliser shuts the persistent workers down

    return take, lambda batch: [sample_index(sample) for sample in batch.numpy()], close


def _dali_pipeline(workload: str, workers: int, start_method: str, dropin: bool, consumed: bool = False):
    """The same pipeline code for both: only the import differs."""
    if dropin:
        from extsrc import fn, pipeline_def
    else:
        from nvidia.dali import fn, pipeline_def
    from extsrc.bench.workloads import CALLBACKS

    callback = CALLBACKS[workload]

    @pipeline_def(batch_size=WORKLOADS[workload].batch_size, num_threads=DALI_THREADS, device_id=None,
                  py_num_workers=workers, py_start_method=start_method)
    def pipeline():
        samples = fn.external_source(source=callback, batch=False, parallel=True)
        return samples[0:8] if consumed else samples

    return pipeline


def _indices_dali(output) -> List[int]:
    import numpy as np

    from extsrc.bench.workloads import sample_index

    return [sample_index(np.asarray(output[k])) for k in range(len(output))]


def _open_dali(workload: str, workers: int, start_method: str, dropin: bool, consumed: bool = False):
    pipe = _dali_pipeline(workload, workers, start_method, dropin, consumed)()
    pipe.build()
    state = {"pipe": pipe}

    def take():
        (output,) = state["pipe"].run()
        len(output)  # the consumer touches the batch
        return output

    def close():
        state.clear()

    return take, _indices_dali, close


def _open(loader: str, workload: str, workers: int, start_method: str, consumed: bool = False):
    if loader == EXTSRC:
        return _open_extsrc(workload, workers, start_method)
    if loader == TORCH:
        return _open_torch(workload, workers, start_method)
    if loader in (DALI, EXTSRC_DALI):
        return _open_dali(workload, workers, start_method, dropin=loader == EXTSRC_DALI, consumed=consumed)
    raise ValueError(f"unknown loader {loader!r}")


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


class _CpuMeter:
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


def _measure(take: Take, seconds: float, warmup_s: float, warmup_batches: int = 8):
    """Skips a warm-up, then takes batches for ``seconds``.

    Returns (timed batches, elapsed s, CPU figures, all batches taken, last batch).
    """
    started = time.perf_counter()
    total = 0
    batch = None
    while total < warmup_batches or time.perf_counter() - started < warmup_s:
        batch = take()
        total += 1
    meter = _CpuMeter()
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


def _throughput_cell(loader: str, workload: str, seconds: float, warmup_s: float,
                     consumed: bool = False) -> Dict[str, Any]:
    w = WORKLOADS[workload]
    take, indices, close = _open(loader, workload, WORKERS, "fork", consumed)
    try:
        batches, elapsed, cpu, total, last = _measure(take, seconds, warmup_s)
        got = indices(last)
        expected = list(range((total - 1) * w.batch_size, total * w.batch_size))
        if got != expected:
            raise RuntimeError(f"{loader}: batch {total - 1} holds samples {got[:4]}..., "
                               f"expected {expected[:4]}...")
    finally:
        close()
    samples_per_s = batches * w.batch_size / elapsed
    result = {
        "batches": batches,
        "elapsed_s": elapsed,
        "samples_per_s": samples_per_s,
        "mb_per_s": samples_per_s * w.sample_bytes / MB,
        **cpu,  # cores: consumer_cpu (consuming process), loader_cpu (it and its workers), other_cpu
    }
    if w.spin_s:
        result["ideal_fraction"] = samples_per_s / (WORKERS / w.spin_s)
    return result


# The startup cell is a script file, as users run their jobs: with spawn, each worker imports
# the main script again (its top-level imports included), which `python -c` would skip.
_STARTUP_SCRIPT = """\
import json, time
from {module} import fn, pipeline_def
from extsrc.bench.runner import RESULT_MARK, _CpuMeter, _indices_dali
from extsrc.bench.workloads import CALLBACKS, WORKLOADS

@pipeline_def(batch_size=WORKLOADS[{workload!r}].batch_size, num_threads={threads}, device_id=None,
              py_num_workers={workers}, py_start_method="spawn")
def pipeline():
    return fn.external_source(source=CALLBACKS[{workload!r}], batch=False, parallel=True)

if __name__ == "__main__":
    meter = _CpuMeter()
    defined = time.perf_counter()
    pipe = pipeline()
    built = time.perf_counter()
    pipe.build()
    (output,) = pipe.run()
    first = time.perf_counter()
    cpu = meter.stop()
    if _indices_dali(output) != list(range(WORKLOADS[{workload!r}].batch_size)):
        raise RuntimeError("the first batch does not hold samples 0, 1, ...")
    print(RESULT_MARK + json.dumps({{"startup_s": first - built, "create_to_first_s": first - defined, **cpu}}),
          flush=True)
"""


def startup_script(loader: str, workload: str) -> str:
    """The script of a startup cell: a user's job from its imports to the first batch."""
    if loader not in (DALI, EXTSRC_DALI):
        raise ValueError(f"no startup cell for {loader!r}")
    module = "extsrc" if loader == EXTSRC_DALI else "nvidia.dali"
    return _STARTUP_SCRIPT.format(module=module, workload=workload, threads=DALI_THREADS,
                                  workers=STARTUP_WORKERS)


def _cell_main(argv: Sequence[str]) -> int:
    """Entry point of a cell subprocess: runs one cell, prints its figures as one JSON line."""
    spec = json.loads(argv[0])
    result = _throughput_cell(spec["loader"], spec["workload"], spec["seconds"], spec["warmup_s"],
                              spec.get("consumed", False))
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cell(spec: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """Runs one cell in a fresh interpreter; its figures, or ``{"error": text}``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="extsrc-bench-") as folder:
        script = os.path.join(folder, "job.py")
        with open(script, "w") as f:
            f.write(startup_script(spec["loader"], spec["workload"]) if spec.get("startup")
                    else _CELL_CODE)
        return _run_script([sys.executable, script, json.dumps(spec)], env, timeout)


def _run_script(command: List[str], env: Dict[str, str], timeout: float) -> Dict[str, Any]:
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,  # so that a stuck cell is killed with all its workers
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except BaseException as exc:
        _kill_group(process)
        process.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            return {"error": f"did not finish within {timeout:g} s (killed)"}
        raise
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    lines = (err or out).strip().splitlines()
    last = lines[-1] if lines else "no output"
    return {"error": f"exit code {process.returncode}: {last}", "stderr": "\n".join(lines[-40:])}


def _kill_group(process: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# -- the run: interleaved cells, medians, the tables ----------------------------------------


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _version(distribution: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


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


def _figure(row: Row, runs: List[Dict[str, Any]]) -> str:
    """One loader's cell of the printed table (``*``: every run was disturbed)."""
    if not runs:
        return "n/a"
    runs, disturbed = _usable(runs)
    if not runs:
        return "error"
    mark = " *" if disturbed else ""
    if row.startup:
        return f"{_median(runs, 'startup_s'):.2f} s{mark}"
    w = WORKLOADS[row.workload]
    rate = _median(runs, "samples_per_s")
    if w.spin_s:
        return f"{rate:,.0f} samples/s ({_median(runs, 'ideal_fraction'):.2f} of ideal){mark}"
    if w.sample_bytes >= 1 << 20:
        return f"{_median(runs, 'mb_per_s'):,.0f} MB/s ({rate:,.0f} samples/s){mark}"
    return f"{rate / 1e3:,.1f}k samples/s{mark}"


def _compare(row: Row, ours: List[Dict[str, Any]], peer: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The ratio of a row and whether its target is met (None where it cannot be told)."""
    ours_ok, ours_disturbed = _usable(ours)
    peer_ok, peer_disturbed = _usable(peer)
    ratio = None
    if row.startup:
        if ours_ok and peer_ok:
            ratio = _median(peer_ok, "startup_s") / _median(ours_ok, "startup_s")
    elif ours_ok and peer_ok:
        key = "mb_per_s" if row.target.metric == "mb_per_s" else "samples_per_s"
        ratio = _median(ours_ok, key) / _median(peer_ok, key)
    if row.target.metric == "ideal_fraction":
        achieved = _median(ours_ok, "ideal_fraction") if ours_ok else None
    else:
        achieved = ratio
    met = None if achieved is None else achieved >= row.target.value
    return {"ratio": ratio, "achieved": achieved, "met": met,
            "disturbed": ours_disturbed or peer_disturbed}


def format_table(table: Table, results: Dict[Tuple[str, int, str], List[Dict[str, Any]]]) -> str:
    """The Markdown table of one comparison."""
    lines = [f"| workload | {table.ours_name} | {table.peer_name} | ratio | target | met |",
             "|---|---|---|---|---|---|"]
    for i, row in enumerate(table.rows):
        ours = results.get((table.key, i, row.ours), [])
        peer = results.get((table.key, i, row.peer), [])
        verdict = _compare(row, ours, peer)
        ratio = "n/a" if verdict["ratio"] is None else f"{verdict['ratio']:.2f}x"
        target = row.target.describe()
        if row.target.metric == "ideal_fraction" and verdict["achieved"] is not None:
            target += f" (is {verdict['achieved']:.2f})"
        met = {True: "yes", False: "no", None: "n/a"}[verdict["met"]]
        cells = (row.label, _figure(row, ours), _figure(row, peer), ratio, target, met)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _targets_text() -> str:
    lines = ["targets (printed next to the ratios):"]
    for table in (torch_table(), dali_table()):
        lines.append(f"  {table.title}:")
        lines += [f"    {row.label}: {row.target.describe()}" for row in table.rows]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m extsrc bench",
        description=textwrap.fill(
            "Measure extsrc side by side with its peers on the same callbacks (in "
            "extsrc.bench.workloads): small (1 KiB uint8 samples, batch 256), large (4 MiB, "
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
        epilog=_targets_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dali", action="store_true",
                        help="also compare extsrc's DALI drop-in (from extsrc import fn, "
                             "pipeline_def) with DALI's own parallel external source on the "
                             "same pipeline code, plus the time from build() to the first "
                             "batch with spawn and 4 workers (needs nvidia-dali)")
    parser.add_argument("--no-torch", action="store_true",
                        help="skip the PyTorch comparison (with --dali: the DALI one only)")
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

    tables: List[Table] = []
    if not args.no_torch:
        table = torch_table()
        if not _installed("torch"):
            table.note = ("PyTorch is not installed: the DataLoader column is skipped "
                          "(pip install 'extsrc[bench]' to compare)")
        tables.append(table)
    if args.dali:
        if not _installed("nvidia.dali"):
            print("extsrc bench: --dali needs NVIDIA DALI (pip install 'extsrc[dali]')", file=sys.stderr)
            return 2
        tables.append(dali_table())
    if not tables:
        print("extsrc bench: nothing to run (--no-torch without --dali)", file=sys.stderr)
        return 2
    for table in tables:
        table.rows = [r for r in table.rows if r.workload in workloads or r.startup]

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
                "warmup_s": warmup_s, "startup": row.startup, "consumed": row.consumed}
        result = run_cell(spec, args.timeout)
        results.setdefault((table.key, i, loader), []).append(result)
        name = table.ours_name if loader == row.ours else table.peer_name
        if "error" in result:
            failures.append(f"{row.label}, {name}: {result['error']}")
            shown = "FAILED"
        else:
            shown = _figure(row, [result]).rstrip(" *")
            if result.get("other_cpu", 0.0) > QUIET_OTHER_CPU:
                shown += f" (disturbed: other processes used {result['other_cpu']:.2f} cores)"
        print(f"  [{n}/{len(plan)}] {row.label} | {name}: {shown}", file=sys.stderr, flush=True)
    load_end = os.getloadavg()

    versions = {name: _version(dist) for name, dist in
                (("extsrc", "extsrc"), ("numpy", "numpy"), ("torch", "torch"),
                 ("dali", "nvidia-dali-cuda120"))}
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
        _compare(row, results.get((t.key, i, row.ours), []),
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
                    "label": row.label, "workload": row.workload, "startup": row.startup,
                    "target": {"metric": row.target.metric, "value": row.target.value,
                               "text": row.target.describe()},
                    table.ours_name: ours, table.peer_name: peer,
                    **_compare(row, ours, peer),
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
