"""``python -m extsrc bench --soak MINUTES``: memory over a long run, extsrc beside DALI's own.

A job that runs for days must keep its memory flat. Each loader runs the same workload at the
same time, in a process of its own, for MINUTES: sample sizes that change every epoch (4 KiB to
4 MiB, ragged within a batch), a consumer that holds its last ``HELD`` batches and spends
``STEP_S`` per batch (a training step), and a bad record now and then. Every ``--soak-every``
seconds each process writes what the consumer and each worker hold in private memory (the
kernel's ``Rss`` less ``RssShmem``), the shared memory resident in any of them, each page once
(the sum of their ``Pss_Shmem``), and the total, each page once (the sum of their ``Pss``): the
memory the loader costs the machine. After the warm-up (the first
``WARMUP_SHARE`` of the run) a least-squares line through each trace gives its slope in MiB per
hour, and the median of the slopes between every two readings (Theil-Sen) another; the table
prints both and the peaks side by side, and ``--plot PATH`` draws the traces.

The slopes are taken from *aligned* readings: each in the middle of an epoch of the smallest
samples (the first after ``--soak-every`` seconds), when every larger size of the cycle has
passed through the slots and the loop holds 4 batches of the smallest samples. What a loader
failed to give back since (memory sized by an earlier epoch, a slot or batch not released)
lifts every such reading, and nothing in flight moves one by more than a small batch. A reading
at a random moment moves by up to the 4 held batches of 4 MiB samples (128 MiB); one at the
start of the epoch after the 4 MiB one, by the slots still being refilled (5 minutes, 140
readings each: standard deviation 22 MiB there, 8 in the middle of that epoch, 1.2 in the
middle of the 4 KiB one), enough to turn a 30-minute line by 10 MiB/hour either way.
The peaks are taken from every reading.

extsrc: ``ParallelSource(on_error="skip")``, the batches held as they come (zero-copy). DALI:
its ``fn.external_source(parallel=True)`` in a CPU pipeline with the same callback, whose bad
records return an empty sample instead (DALI has no skip), the outputs held as copies (DALI
reuses its buffers). Targets (issue "memory flat for days"): slope under 1 MiB/hour per process
and for shared memory, no higher peak than DALI's. A batch the loop holds is shared memory in extsrc
(zero-copy) and the consumer's private memory in DALI (a copy), so the total is the fair peak.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import numpy as np

BATCH, WORKERS, HELD = 8, 2, 4
STEP_S = 0.004  # the consumer's work per batch (sleep): a training step, and a light machine load
EPOCH_SAMPLES = 256
EPOCH_BATCHES = EPOCH_SAMPLES // BATCH  # with on_error="skip", a skipped record's place is refilled
SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)  # the epoch's sample size, drawn per epoch
BAD_EVERY = 97  # record 97, 194, ... of each epoch fails
WARMUP_SHARE = 0.2
TARGET_MIB_PER_HOUR = 1.0
LOADERS = ("extsrc", "dali")
CHILD_GRACE_S = 120  # beyond the run: start-up, and the last batch
TREND_POINTS = 2000  # readings the median slope is taken over at most (pairs: their square / 2)
MIN_READINGS = 3  # aligned after the warm-up; a line through fewer has no slope: a run goes on


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--soak`` options of ``python -m extsrc bench``."""
    parser.add_argument("--soak", type=float, metavar="MINUTES", default=None,
                        help="run the soak test for MINUTES (memory traces and slopes, extsrc beside "
                             "DALI's parallel external source) instead of the throughput tables")
    parser.add_argument("--soak-every", type=float, metavar="SECONDS", default=5.0,
                        help="seconds between memory readings of the soak test (default: 5)")
    parser.add_argument("--soak-loaders", default=",".join(LOADERS),
                        help=f"the loaders of the soak test (default: {','.join(LOADERS)})")


def sample(info: Any) -> np.ndarray:
    """The soak workload's callback: an epoch-sized ragged sample; every BAD_EVERY-th record
    fails (``OSError``), as a corrupt file would."""
    if info.idx_in_epoch >= EPOCH_SAMPLES:
        raise StopIteration
    if info.idx_in_epoch and info.idx_in_epoch % BAD_EVERY == 0:
        raise OSError(f"record {info.idx_in_epoch} is corrupt")
    size = _size(info.epoch_idx) - 64 * info.idx_in_batch
    return np.full(max(size, 1), info.idx_in_epoch & 0xFF, np.uint8)


def _size(epoch_idx: int) -> int:
    return SIZES[(epoch_idx * 7919) % len(SIZES)]


def _aligned_at(epoch_idx: int, batch: int) -> bool:
    """Whether the loop's ``batch``-th batch of epoch ``epoch_idx`` is where an aligned reading
    is taken: the middle of an epoch of the smallest samples, after the first cycle of sizes."""
    return epoch_idx >= len(SIZES) and _size(epoch_idx) == min(SIZES) and batch == EPOCH_BATCHES // 2


def sample_or_empty(info: Any) -> np.ndarray:
    """:func:`sample` as a DALI user writes it: a failing record gives an empty sample."""
    try:
        return sample(info)
    except OSError:
        return np.zeros(0, np.uint8)


def _memory(pid: int) -> Dict[str, int]:
    """Resident bytes of ``pid`` from ``/proc/PID/smaps_rollup`` (all 0 once it is gone):
    ``private`` (``Rss`` less its shared memory), ``pss`` (its proportional share of every page,
    so a page mapped by 3 processes counts a third in each) and ``pss_shmem`` (that share of its
    shared memory)."""
    fields: Dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                key, _, value = line.partition(":")
                if key in ("Rss", "Pss", "Pss_Shmem"):
                    fields[key] = int(value.split()[0]) * 1024
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key == "RssShmem":
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        return {"private": 0, "pss": 0, "pss_shmem": 0}
    return {"private": fields.get("Rss", 0) - fields.get("RssShmem", 0), "pss": fields.get("Pss", 0),
            "pss_shmem": fields.get("Pss_Shmem", 0)}


def _children(pid: int) -> List[int]:
    found: List[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return found


def _reading(start: float, batches: int) -> Dict[str, Any]:
    """One reading: the consumer's and each worker's private memory, the shared memory of them
    all (each page once, wherever it is mapped) and their total (each page once)."""
    me = os.getpid()
    consumer = _memory(me)
    workers = [_memory(pid) for pid in _children(me)]
    every = [consumer, *workers]
    return {"t": time.monotonic() - start, "batches": batches, "consumer": consumer["private"],
            "workers": [w["private"] for w in workers],
            "shared": sum(m["pss_shmem"] for m in every), "total": sum(m["pss"] for m in every)}


def _extsrc_batches() -> Any:
    import extsrc
    from benchmarks.soak import sample as callback  # by its module, not __main__

    source = extsrc.ParallelSource(callback, BATCH, num_workers=WORKERS, on_error="skip",
                                   last_batch="partial", batches_held=HELD)
    epoch = 0
    while True:
        for batch in source:
            yield epoch, batch
        epoch += 1


def _dali_batches() -> Any:
    from nvidia.dali import fn, pipeline_def

    from benchmarks.soak import sample_or_empty as callback  # by its module, not __main__

    @pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, py_num_workers=WORKERS,
                  py_start_method="fork")
    def pipe() -> Any:
        return fn.external_source(callback, batch=False, parallel=True)

    dali = pipe()
    dali.build()
    epoch = 0
    while True:
        try:
            (out,) = dali.run()
        except StopIteration:
            dali.reset()
            epoch += 1
            continue
        yield epoch, [np.array(out[k]) for k in range(len(out))]  # DALI reuses its buffers: copies


def child(loader: str, seconds: float, every: float, path: str) -> None:
    """Runs one loader for ``seconds``, writing a JSON reading to ``path`` every ``every`` s,
    and an aligned one (:func:`_aligned_at`) at the first chance after every ``every`` s."""
    batches = _extsrc_batches() if loader == "extsrc" else _dali_batches()
    held: collections.deque = collections.deque(maxlen=HELD)
    start = time.monotonic()
    next_reading = next_aligned = start
    count, aligned, last_epoch, in_epoch = 0, 0, -1, 0
    with open(path, "w") as out:
        for epoch, batch in batches:
            held.append(batch)
            count += 1
            in_epoch, last_epoch = (in_epoch + 1 if epoch == last_epoch else 0), epoch
            time.sleep(STEP_S)
            now = time.monotonic()
            if now >= next_reading:
                out.write(json.dumps({**_reading(start, count), "aligned": False}) + "\n")
                next_reading += every
            if _aligned_at(epoch, in_epoch) and now >= next_aligned:
                out.write(json.dumps({**_reading(start, count), "aligned": True}) + "\n")
                next_aligned = now + every
                aligned += now - start >= WARMUP_SHARE * seconds  # those the slopes are taken from
            out.flush()
            if now - start >= seconds and aligned >= MIN_READINGS:
                break
    os._exit(0)  # the parent ends the session: DALI's workers outlive their parent


def slope_mib_per_hour(times: List[float], values: List[float]) -> Optional[float]:
    """The least-squares slope of ``values`` (bytes) over ``times`` (s), in MiB per hour."""
    if len(times) < 3 or max(times) - min(times) <= 0:
        return None
    return float(np.polyfit(np.array(times), np.array(values, dtype=float), 1)[0]) * 3600 / (1 << 20)


def trend_mib_per_hour(times: List[float], values: List[float]) -> Optional[float]:
    """The Theil-Sen slope of ``values`` (bytes) over ``times`` (s), in MiB per hour: the median
    of the slopes between every two readings (of at most ``TREND_POINTS`` evenly spread), which
    a few readings caught with a sample in flight do not move, where they turn a least-squares
    line by MiB/hour."""
    if len(times) < 3 or max(times) - min(times) <= 0:
        return None
    pick = np.linspace(0, len(times) - 1, min(len(times), TREND_POINTS)).astype(int)
    t, v = np.array(times, dtype=float)[pick], np.array(values, dtype=float)[pick]
    first, second = np.triu_indices(len(t), k=1)
    apart = t[second] - t[first]
    slopes = (v[second] - v[first])[apart > 0] / apart[apart > 0]
    return float(np.median(slopes)) * 3600 / (1 << 20)


def summary(readings: List[Dict[str, Any]], minutes: float) -> Dict[str, Any]:
    """Slopes of the aligned readings after the warm-up (the median one and the least-squares
    one), and peaks of every reading after it, of one loader."""
    after = [r for r in readings if r["t"] >= WARMUP_SHARE * minutes * 60]
    lined = [r for r in after if r["aligned"]]
    traces, every = _traces(lined), _traces(after)
    times = [r["t"] for r in lined]
    return {"slopes": {name: trend_mib_per_hour(times, values) for name, values in traces.items()},
            "lsq": {name: slope_mib_per_hour(times, values) for name, values in traces.items()},
            "peaks": {name: max(values, default=0) for name, values in every.items()},
            "batches": max((r["batches"] for r in readings), default=0)}


def _traces(readings: List[Dict[str, Any]]) -> Dict[str, List[int]]:
    """Each trace's values over ``readings``: consumer, shared, total and worker K."""
    traces = {name: [r[name] for r in readings] for name in ("consumer", "shared", "total")}
    width = max((len(r["workers"]) for r in readings), default=0)
    for k in range(width):
        traces[f"worker {k}"] = [r["workers"][k] if k < len(r["workers"]) else 0 for r in readings]
    return traces


def run(args: argparse.Namespace) -> int:
    """``--soak MINUTES``: the loaders side by side; the table; 1 when a loader failed."""
    minutes = float(args.soak)
    loaders = [name.strip() for name in args.soak_loaders.split(",") if name.strip()]
    if minutes <= 0 or not loaders or any(name not in LOADERS for name in loaders):
        print(f"extsrc bench: --soak needs MINUTES > 0 and loaders among {LOADERS}", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__))]
                                                        + sys.path)}
    folder = tempfile.mkdtemp(prefix="extsrc-soak-")
    runs = {name: subprocess.Popen([sys.executable, "-m", "benchmarks.soak", name, str(minutes * 60),
                                    str(args.soak_every), os.path.join(folder, name)],
                                   env=env, start_new_session=True)
            for name in loaders}
    results: Dict[str, Dict[str, Any]] = {}
    failed = False
    for name, process in runs.items():
        try:
            process.wait(timeout=minutes * 60 + CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            failed = True
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the loader's workers, whoever they are
        except ProcessLookupError:
            pass
        process.wait()
        with open(os.path.join(folder, name)) as f:
            readings = [json.loads(line) for line in f if line.startswith("{")]
        failed |= process.returncode not in (0, -signal.SIGKILL) or not readings
        results[name] = {"readings": readings, **summary(readings, minutes)}
    shutil.rmtree(folder, ignore_errors=True)
    _print(results, minutes)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(results, f)
    if getattr(args, "plot", None):
        _plot(args.plot, results, minutes)
    return 1 if failed else 0


def _print(results: Dict[str, Dict[str, Any]], minutes: float) -> None:
    print(f"soak: {minutes:g} min, batch {BATCH}, {WORKERS} workers, {HELD} batches held, "
          f"sizes {[s >> 10 for s in SIZES]} KiB by epoch, every {BAD_EVERY}th record bad; "
          f"slopes after the first {WARMUP_SHARE:.0%} (target < {TARGET_MIB_PER_HOUR:g} MiB/hour)")
    names = sorted({trace for r in results.values() for trace in r["slopes"]})
    print(f"{'trace':<12}" + "".join(f"{n + ' MiB/h':>16}{'lsq':>8}{n + ' peak MiB':>18}" for n in results))
    for trace in names:
        row = f"{trace:<12}"
        for r in results.values():
            slope, lsq, peak = r["slopes"].get(trace), r["lsq"].get(trace), r["peaks"].get(trace, 0)
            row += (f"{'n/a' if slope is None else f'{slope:+.2f}':>16}"
                    f"{'n/a' if lsq is None else f'{lsq:+.2f}':>8}{peak / (1 << 20):>18.1f}")
        print(row)
    print("MiB/h: the median slope between two aligned readings after the warm-up; lsq: the "
          "least-squares line's")
    print("batches: " + ", ".join(f"{n} {r['batches']}" for n, r in results.items()))
    if "extsrc" in results and "dali" in results:
        ours, theirs = results["extsrc"]["peaks"], results["dali"]["peaks"]
        for trace in ("consumer", "shared", "total"):
            if theirs.get(trace):
                print(f"peak {trace}: extsrc / DALI = {ours.get(trace, 0) / theirs[trace]:.2f}")


def _plot(path: str, results: Dict[str, Dict[str, Any]], minutes: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        lined = [x for x in r["readings"] if x["aligned"]]
        every, times = _traces(r["readings"]), [x["t"] / 60 for x in r["readings"]]
        lined_times = [x["t"] / 60 for x in lined]
        for trace, values in _traces(lined).items():  # every reading's as dots, in the same colour
            line, = ax.plot(lined_times, [v / (1 << 20) for v in values], label=trace)
            ax.plot(times, [v / (1 << 20) for v in every.get(trace, [])], ".", markersize=1.5,
                    color=line.get_color(), alpha=0.4)
        ax.axvline(WARMUP_SHARE * minutes, color="#aaa", linestyle=":")
        ax.set_title(name)
        ax.set_xlabel("minutes")
        ax.set_ylabel("MiB resident")
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    child(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
