"""``python -m extsrc bench --images``: five loaders on one JPEG workload, in images/s.

The workload is a training input pipeline: read a JPEG from disk, decode it,
random resized crop to 224, flip, normalise (:mod:`benchmarks.augment`),
over a cached set of synthetic photographs (:mod:`benchmarks.imageset`).
The loaders (:mod:`benchmarks.image_loaders`), each with the same number of
worker processes and decoding threads:

1. extsrc's DALI drop-in: a parallel external source reading file bytes,
   DALI's CPU decoder and operators;
2. DALI's own parallel external source, the same pipeline code;
3. DALI's C++ ``fn.readers.file`` with the same operators;
4. PyTorch's DataLoader, PIL and torchvision's transforms;
5. ``extsrc.ParallelSource`` decoding with PIL in the callback;
6. DALI's dynamic mode, the same operators called eagerly on the batches of
   ``extsrc.dynamic``'s parallel ``ExternalSource``;
7. the same with DALI's own ``ndd.ExternalSource`` (in the consumer's thread);
8. and 9. the same two sources decoding with PIL themselves (a CPU-bound
   callback), DALI flipping and normalising.

The figures compare the drop-in with each (targets: at least even with DALI's
parallel external source, >= 1.3x the DataLoader, >= 0.9x ``fn.readers.file``)
and the engine with the DataLoader (both decode with PIL); in dynamic mode,
the parallel source with the in-process one (target >= 1.8x) and with the
drop-in (>= 0.9x). Every cell runs in
a fresh process, the loaders take turns in each repeat, and figures are
medians over repeats; all files are read once first, so every loader reads
from the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from benchmarks import imageset
from benchmarks.augment import SIZE
from benchmarks.cells import run_cell
from benchmarks.packages import installed, version
from benchmarks.image_loaders import (
    DALI_LOADERS, DALI_READER, DALI_SOURCE, DECODES, DEVICES, EXTSRC, EXTSRC_DALI, EXTSRC_NDD, EXTSRC_NDD_PIL,
    NDD, NDD_PIL, TORCH,
)
from benchmarks.tables import QUIET_OTHER_CPU

DEFAULT_WORKERS = 2
DEFAULT_BATCH = 32
PROBE_TIMEOUT_S = 120.0  # importing torchvision (and torch with it) in a fresh interpreter
REFERENCE = EXTSRC_DALI  # the column every ratio is taken against
NDD_OVER_IN_PROCESS, NDD_OVER_DROP_IN = 1.8, 0.9  # dynamic mode's targets (see dynamic_mode)


@dataclass(frozen=True)
class Column:
    """One loader of the table; ``target``: the drop-in's images/s over this one's must reach it."""

    loader: str
    name: str
    target: Optional[float] = None
    note: Optional[str] = None  # why the column cannot run here (then it is skipped)


@dataclass(frozen=True)
class ImageBench:
    """The settings of an images run, checked once by :func:`settings`."""

    spec: imageset.ImageSetSpec
    root: Optional[str]
    workers: int
    batch_size: int
    device: str
    decode: str
    seconds: float
    warmup_s: float
    repeat: int
    timeout: float
    plot: Optional[str]
    json_path: Optional[str]


@dataclass(frozen=True)
class Figures:
    """One loader's figures: medians of its usable runs, and the reference's ratio to it."""

    loader: str
    name: str
    images_per_s: Optional[float]  # None: not run, or every run failed
    slowest: Optional[float]  # images/s of the slowest and fastest usable run
    fastest: Optional[float]
    cores: Optional[float]  # CPU cores used by the loader (its process and workers)
    per_core: Optional[float]  # images per core-second
    consumer_ms: Optional[float]  # CPU of the consuming (training) process per batch, all threads
    ratio: Optional[float]  # the reference's images/s over this loader's
    target: Optional[float]
    met: Optional[bool]
    disturbed: bool  # every usable run shared the CPUs with other processes
    note: Optional[str]
    runs: Tuple[Dict[str, Any], ...]


@dataclass
class Results:
    """The runs of every loader (one dict per cell), in the order they ran."""

    runs: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--images`` options of ``python -m extsrc bench``."""
    group = parser.add_argument_group("image workload (--images)", textwrap.fill(
        "JPEGs from disk: decode, random resized crop to 224, flip, normalize, in images/s on "
        "the CPU, for extsrc's drop-in + DALI's decoder, DALI's parallel external source, "
        "DALI's fn.readers.file, PyTorch's DataLoader + PIL + torchvision, and "
        "extsrc.ParallelSource decoding with PIL. The images are generated once and cached.", 79))
    group.add_argument("--images", action="store_true",
                       help="run the image workload (instead of the synthetic workloads)")
    group.add_argument("--image-count", type=int, default=imageset.DEFAULT_COUNT, metavar="N",
                       help=f"images in the set (default {imageset.DEFAULT_COUNT:,})")
    group.add_argument("--image-size", default="%dx%d" % imageset.DEFAULT_SIZE, metavar="WxH",
                       help="width x height of the images (default %dx%d)" % imageset.DEFAULT_SIZE)
    group.add_argument("--image-workers", type=int, default=DEFAULT_WORKERS, metavar="N",
                       help=f"worker processes of every loader, and DALI's num_threads (default "
                            f"{DEFAULT_WORKERS})")
    group.add_argument("--image-batch", type=int, default=DEFAULT_BATCH, metavar="N",
                       help=f"batch size (default {DEFAULT_BATCH})")
    group.add_argument("--image-device", choices=DEVICES, default="cpu",
                       help="where DALI decodes: cpu (default) or mixed (on GPU 0; the PIL loaders "
                            "stay on the CPU)")
    group.add_argument("--image-decode", choices=DECODES, default="crop",
                       help="how the DALI pipelines crop: crop (default: decode only the random "
                            "window, fn.decoders.image_random_crop + fn.resize, DALI's form for "
                            "training) or full (fn.decoders.image, then fn.random_resized_crop)")
    group.add_argument("--images-dir", metavar="PATH",
                       help=f"cache folder of the image sets (default {imageset.default_root()})")
    group.add_argument("--plot", metavar="PATH",
                       help="also draw the images/s (--images) or the samples/s (--remote) as "
                            "a bar chart into PATH (.png, .svg, .pdf; needs matplotlib)")


def targets_text() -> str:
    """The targets of the image table, for ``--help``."""
    lines = ["  images (extsrc drop-in + DALI decoder, images/s, vs):"]
    lines += [f"    {c.name}: >= {c.target:g}x" for c in columns("torchvision")
              if c.target is not None]
    return "\n".join(lines)


def _size(text: str) -> Tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--image-size must be WIDTHxHEIGHT (e.g. 500x375), got {text!r}") from None
    return width, height


def settings(args: argparse.Namespace, seconds: float, warmup_s: float, repeat: int) -> ImageBench:
    """The run's settings from the parsed arguments; ``ValueError`` says which one is wrong."""
    width, height = _size(args.image_size)
    spec = imageset.ImageSetSpec.create(count=args.image_count, width=width, height=height)
    for name, value in (("--image-workers", args.image_workers), ("--image-batch", args.image_batch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if args.plot and not installed("matplotlib"):
        raise ValueError("--plot needs matplotlib (pip install matplotlib, or 'extsrc[bench]')")
    return ImageBench(spec, args.images_dir, args.image_workers, args.image_batch, args.image_device,
                      args.image_decode, seconds, warmup_s, repeat, args.timeout, args.plot, args.json)


def columns(transforms: str) -> List[Column]:
    """The loaders of the table, the reference first."""
    augment_name = ("torchvision" if transforms == "torchvision"
                    else "PIL/NumPy transforms (torchvision unusable here)")
    return [
        Column(EXTSRC_DALI, "extsrc drop-in + DALI decoder"),
        Column(DALI_SOURCE, "DALI parallel external source + DALI decoder", 1.0),
        Column(DALI_READER, "DALI fn.readers.file + DALI decoder", 0.9),
        Column(TORCH, f"PyTorch DataLoader + PIL + {augment_name}", 1.3),
        Column(EXTSRC, "extsrc.ParallelSource + PIL/NumPy in the callback"),
        Column(EXTSRC_NDD, "dynamic mode: extsrc.dynamic parallel source + DALI decoder"),
        Column(NDD, "dynamic mode: DALI's ndd.ExternalSource (in-process) + DALI decoder"),
        Column(EXTSRC_NDD_PIL, "dynamic mode: extsrc.dynamic parallel source decoding with PIL"),
        Column(NDD_PIL, "dynamic mode: DALI's ndd.ExternalSource (in-process) decoding with PIL"),
    ]




def torchvision_usable() -> Tuple[bool, str]:
    """Whether torchvision's transforms import here, asked in a fresh interpreter: (ok, why not).

    An installed torchvision built for another torch fails at import
    (``operator torchvision::nms does not exist``), so finding it is not enough.
    """
    if not installed("torchvision"):
        return False, "torchvision is not installed"
    try:
        out = subprocess.run([sys.executable, "-c", "import torchvision.transforms"], capture_output=True,
                             text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"importing torchvision took more than {PROBE_TIMEOUT_S:g} s"
    if out.returncode == 0:
        return True, ""
    lines = out.stderr.strip().splitlines()
    return False, f"importing torchvision fails: {lines[-1] if lines else out.returncode}"


def _plan_columns(no_torch: bool) -> Tuple[List[Column], List[str], str]:
    """The columns (with a note on those that cannot run here), the notes to print, the transforms."""
    notes = []
    transforms = "torchvision"
    torch_note = None
    if no_torch:
        torch_note = "--no-torch: the DataLoader column is skipped"
    elif not installed("torch"):
        torch_note = "PyTorch is not installed: the DataLoader column is skipped (pip install 'extsrc[bench]')"
    else:
        usable, why = torchvision_usable()
        if not usable:
            transforms = "numpy"
            notes.append(f"{why}: the DataLoader column runs the same operations in PIL and NumPy "
                         "(benchmarks.augment); install the torchvision built for this torch to compare "
                         "with torchvision itself.")
    dali_note = None
    if not installed("nvidia.dali"):
        dali_note = "NVIDIA DALI is not installed: the DALI columns are skipped (pip install 'extsrc[dali]')"
    result = []
    for column in columns(transforms):
        note = torch_note if column.loader == TORCH else dali_note if column.loader in DALI_LOADERS else None
        result.append(Column(column.loader, column.name, column.target, note))
    notes += sorted({c.note for c in result if c.note})
    return result, notes, transforms


def _usable(runs: List[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], bool]:
    """The runs a figure is made of (the undisturbed ones, when any), and whether all were disturbed."""
    ok = [run for run in runs if "error" not in run]
    quiet = [run for run in ok if run.get("other_cpu", 0.0) <= QUIET_OTHER_CPU]
    return (quiet, False) if quiet else (ok, bool(ok))


def _median(runs: List[Dict[str, Any]], key: str) -> Optional[float]:
    values = [run[key] for run in runs if key in run]
    return statistics.median(values) if values else None


def summary(columns_: List[Column], results: Results) -> List[Figures]:
    """The figures of every column, in order."""
    reference_runs, _ = _usable(results.runs.get(REFERENCE, []))
    reference = _median(reference_runs, "images_per_s")
    rows = []
    for column in columns_:
        runs, disturbed = _usable(results.runs.get(column.loader, []))
        rate = _median(runs, "images_per_s")
        ratio = reference / rate if reference and rate and column.loader != REFERENCE else None
        met = None if ratio is None or column.target is None else ratio >= column.target
        rates = [run["images_per_s"] for run in runs]
        rows.append(Figures(
            column.loader, column.name, rate, min(rates, default=None), max(rates, default=None),
            _median(runs, "loader_cpu"), _median(runs, "images_per_core_s"),
            _median(runs, "consumer_ms_per_batch"), ratio, column.target, met,
            disturbed, column.note, tuple(results.runs.get(column.loader, []))))
    return rows


def engine_vs_dataloader(rows: List[Figures]) -> Optional[float]:
    """extsrc.ParallelSource's images/s over the DataLoader's (both decode with PIL)."""
    rates = {row.loader: row.images_per_s for row in rows}
    if rates.get(EXTSRC) and rates.get(TORCH):
        return rates[EXTSRC] / rates[TORCH]
    return None


def dynamic_mode(rows: List[Figures]) -> Optional[Tuple[float, float]]:
    """In dynamic mode, extsrc's parallel source's images/s over DALI's in-process one's, both
    decoding in the source (PIL: the CPU-bound callback), and over the drop-in's with DALI's
    decoder (the same operators, the same bytes read)."""
    rates = {row.loader: row.images_per_s for row in rows}
    if all(rates.get(k) for k in (EXTSRC_NDD_PIL, NDD_PIL, EXTSRC_NDD, EXTSRC_DALI)):
        return rates[EXTSRC_NDD_PIL] / rates[NDD_PIL], rates[EXTSRC_NDD] / rates[EXTSRC_DALI]
    return None


def format_table(rows: List[Figures]) -> str:
    """The Markdown table: one row per loader, ratios against the drop-in."""
    lines = ["| loader | images/s | cores used | images per core-second | consumer CPU per batch "
             "| extsrc drop-in / this | target | met |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.images_per_s is None:
            rate = "error" if row.runs else "n/a"
        else:
            rate = f"{row.images_per_s:,.0f}{' *' if row.disturbed else ''}"
        cores = "" if row.cores is None else f"{row.cores:.2f}"
        per_core = "" if row.per_core is None else f"{row.per_core:,.0f}"
        consumer = "" if row.consumer_ms is None else f"{row.consumer_ms:.2f} ms"
        if row.loader == REFERENCE:
            ratio = "n/a" if row.images_per_s is None else "1.00x (reference)"
        else:
            ratio = "n/a" if row.ratio is None else f"{row.ratio:.2f}x"
        target = "" if row.target is None else f">= {row.target:g}x"
        met = "" if row.target is None else {True: "yes", False: "no", None: "n/a"}[row.met]
        lines.append("| " + " | ".join((row.name, rate, cores, per_core, consumer, ratio, target, met)) + " |")
    return "\n".join(lines)


def title(bench: ImageBench, images: imageset.ImageSet) -> str:
    spec = bench.spec
    where = ("DALI decoding on GPU 0 (device='mixed'), PIL on the CPU" if bench.device == "mixed"
             else "on the CPU")
    return (f"Images/s, {where}: decode, random resized crop to {SIZE}, flip, normalize; "
            f"{len(images):,} JPEGs {spec.width}x{spec.height} q{spec.quality} "
            f"({images.total_bytes / len(images) / 1e3:.0f} KB average), batch {bench.batch_size}, "
            f"{bench.workers} workers per loader (DataLoader, extsrc: num_workers={bench.workers}; DALI: "
            f"num_threads={bench.workers}, py_num_workers={bench.workers}); DALI "
            + ("decodes only the crop's window (fn.decoders.image_random_crop + fn.resize)"
               if bench.decode == "crop" else "decodes whole images (fn.decoders.image + fn.random_resized_crop)"))


def _cell_spec(bench: ImageBench, column: Column, folder: str, transforms: str) -> Dict[str, Any]:
    return {"kind": "images", "loader": column.loader, "folder": folder, "batch_size": bench.batch_size,
            "workers": bench.workers, "seconds": bench.seconds, "warmup_s": bench.warmup_s,
            "transforms": transforms, "device": bench.device, "decode": bench.decode}


def _shown(result: Dict[str, Any]) -> str:
    if "error" in result:
        return "FAILED"
    text = f"{result['images_per_s']:,.0f} images/s, {result.get('loader_cpu', 0.0):.2f} cores"
    if result.get("other_cpu", 0.0) > QUIET_OTHER_CPU:
        text += f" (disturbed: other processes used {result['other_cpu']:.2f} cores)"
    return text


def run(args: argparse.Namespace, seconds: float, warmup_s: float, repeat: int) -> int:
    """``python -m extsrc bench --images``; returns the exit code (0: every cell ran, 1: one failed)."""
    try:
        bench = settings(args, seconds, warmup_s, repeat)
    except ValueError as exc:
        print(f"extsrc bench: {exc}", file=sys.stderr)
        return 2
    if bench.device == "mixed":
        from extsrc.engine.cuda_state import gpu_visible

        visible, why = gpu_visible()
        if not visible:
            print(f"extsrc bench: --image-device mixed decodes on a GPU, but {why}", file=sys.stderr)
            return 2
    cols, notes, transforms = _plan_columns(args.no_torch)
    generators = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        images = imageset.ensure(bench.spec, bench.root, processes=generators)
    except OSError as exc:
        print(f"extsrc bench: cannot make the image set under {bench.root or imageset.default_root()}: {exc} "
              "(choose another folder with --images-dir)", file=sys.stderr)
        return 2
    imageset.read_all(images)
    runnable = [c for c in cols if c.note is None]
    plan = []
    for r in range(bench.repeat):
        shift = r % len(runnable)  # each loader runs first in some repeat: drift spreads over all
        plan += runnable[shift:] + runnable[:shift]
    print(f"extsrc bench --images: {len(images):,} images in {images.folder}; {len(plan)} cells "
          f"({bench.repeat} x {len(runnable)}), {bench.seconds:g} s timed + {bench.warmup_s:g} s warm-up "
          "each, every cell in a fresh process", file=sys.stderr)
    load_start = os.getloadavg()
    started = time.time()
    results = Results()
    failures = []
    for n, column in enumerate(plan, 1):
        result = run_cell(_cell_spec(bench, column, images.folder, transforms), bench.timeout)
        results.runs.setdefault(column.loader, []).append(result)
        if "error" in result:
            failures.append(f"{column.name}: {result['error']}")
        print(f"  [{n}/{len(plan)}] {column.name}: {_shown(result)}", file=sys.stderr, flush=True)
    load_end = os.getloadavg()

    rows = summary(cols, results)
    versions = {name: version(dist) for name, dist in (
        ("extsrc", "extsrc"), ("numpy", "numpy"), ("pillow", "pillow"), ("torch", "torch"),
        ("torchvision", "torchvision"), ("dali", "nvidia-dali-cuda120"))}
    heading = title(bench, images)
    print()
    print(f"Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
          + f"; load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end")
    print(f"Median of {bench.repeat} run(s) per loader, loaders in turn, {bench.seconds:g} s timed after "
          f"{bench.warmup_s:g} s warm-up, each in a fresh process.")
    print()
    print(f"{heading}:")
    for note in notes:
        print(note)
    print(format_table(rows))
    ratio = engine_vs_dataloader(rows)
    if ratio is not None:
        print(f"\nextsrc.ParallelSource vs PyTorch DataLoader, both decoding with PIL: {ratio:.2f}x images/s")
    dynamic = dynamic_mode(rows)
    if dynamic is not None:
        print(f"\ndynamic mode, extsrc.dynamic's parallel source vs DALI's in-process ndd.ExternalSource, "
              f"both decoding with PIL in the source: {dynamic[0]:.2f}x (target >= {NDD_OVER_IN_PROCESS:g}x); "
              f"with DALI's decoder vs the pipeline drop-in: {dynamic[1]:.2f}x (target >= {NDD_OVER_DROP_IN:g}x)")
    if any(row.disturbed for row in rows):
        print(f"\n* every run of this figure shared the CPUs with other processes (more than "
              f"{QUIET_OTHER_CPU:g} cores on average): it is low; rerun on a quieter machine or with "
              "a larger --repeat.")
    if failures:
        print("\nFailed cells:", file=sys.stderr)
        for failure in failures:
            print(f"  {failure}", file=sys.stderr)
    if bench.json_path:
        _write_json(bench, images, heading, rows, ratio, versions, (load_start, load_end), time.time() - started)
    if bench.plot:
        from benchmarks.plot import image_chart

        image_chart(bench.plot, heading, rows, REFERENCE)
        print(f"\nplot: {os.path.abspath(bench.plot)}")
    return 1 if failures else 0


def _write_json(bench: ImageBench, images: imageset.ImageSet, heading: str, rows: List[Figures],
                ratio: Optional[float], versions: Dict[str, Optional[str]],
                loadavg: Tuple[Any, Any], wall_s: float) -> None:
    report = {
        "settings": {"images": asdict(bench.spec), "folder": images.folder, "workers": bench.workers,
                     "batch_size": bench.batch_size, "device": bench.device, "decode": bench.decode, "seconds": bench.seconds,
                     "warmup_s": bench.warmup_s, "repeat": bench.repeat},
        "environment": {"python": platform.python_version(), "cpus": os.cpu_count(), "versions": versions,
                        "loadavg_start": loadavg[0], "loadavg_end": loadavg[1], "wall_s": wall_s},
        "title": heading,
        "reference": REFERENCE,
        "loaders": [asdict(row) for row in rows],
        "engine_vs_dataloader": ratio,
    }
    with open(bench.json_path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")

