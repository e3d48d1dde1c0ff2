"""The engine against the callback's own limit, interleaved: ``python benchmarks/ceiling.py``.

Its rows, each a ratio measured many times, alternating the reference and the engine
(and, with several ``--tree``, the trees) so that a machine shared with other work slows
them alike:

* ``small``: a fresh 1 KiB uint8 array per sample, batch 256, 2 workers, fork, through
  ``ParallelSource``. Reference: one process calling the callback and copying each sample
  into a batch buffer in a plain loop (rate ``R`` per core).
* ``small-p2``: ``small`` with a given ``prefetch=2`` (as the DALI drop-in's
  ``prefetch_queue_depth`` and ``from_dataset``'s ``prefetch_factor`` give one) rather than
  the engine's default.
* ``small-arrays``: the same with ``Hooks(dense_arrays=True)`` (each batch one array, as the
  reference's, rather than a ``Batch`` list of per-sample views).
* ``ragged``: a fresh uint8 array of 256 B to 1.75 KiB per sample (1 KiB on average, its size
  changing from sample to sample), batch 256, through ``ParallelSource`` (each batch a list of
  arrays). Reference: the callback, and each sample copied after the last into a batch buffer.
* ``large``: a fresh 4 MiB uint8 array per sample, batch 16, 2 workers, fork, through the
  DALI drop-in (``extsrc.fn.external_source``), output sliced to 8 bytes (an operator
  consumes it). Reference: the callback plus one copy of its sample into a reused batch
  buffer, in one process.

The ratio is ``engine / (workers * R)``, from a reference and an engine run back to back;
with ``--pair`` the script also runs the reference loop in ``workers`` processes at once
(``P``, their rates summed: what the machine's cores and memory give when both work, which
on a shared virtual machine can be well below ``workers * R`` for the large row) and
prints ``engine / P`` as well;
the script prints each round, then the median and the range per row and tree. It also
prints the CPU time per sample of each (the engine's: its process and workers together) and
their quotient, the share of the engine's CPU that the callback's loop would need: a figure
that other work on the machine disturbs less than rates do (it does not see idle cores). Each run is
a process of its own (``PYTHONPATH`` = the tree), so trees are compared with the same
script: ``--tree /work/wt --tree /tmp/base``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

KIB, MIB = 1 << 10, 1 << 20
WORKERS = 2
ROWS = {"small": (KIB, 256), "small-p2": (KIB, 256), "small-arrays": (KIB, 256), "ragged": (KIB, 256),
        "large": (4 * MIB, 16)}
WARMUP_S = 1.0  # workers started, memory faulted in, caches warm before the clock starts


def make(sample_info, nbytes: int) -> np.ndarray:
    """A new uint8 array of ``nbytes``, every byte written, its index in the first 8."""
    out = np.empty(nbytes, np.uint8)
    out.fill(sample_info.idx_in_epoch & 0xFF)
    out[:8].view(np.int64)[0] = sample_info.idx_in_epoch
    return out


def small(sample_info) -> np.ndarray:
    return make(sample_info, KIB)


def ragged(sample_info) -> np.ndarray:
    """256 B to 1.75 KiB, as the bench's ``ragged`` workload (benchmarks/workloads.py)."""
    return make(sample_info, KIB // 4 + (sample_info.idx_in_epoch * 2654435761) % (3 * KIB // 2))


def large(sample_info) -> np.ndarray:
    return make(sample_info, 4 * MIB)


CALLBACKS = {"small": small, "small-p2": small, "small-arrays": small, "ragged": ragged, "large": large}


def _cpu_s() -> float:
    """CPU seconds used so far by this process and its live descendants (its workers)."""
    total, stack, seen = 0, [os.getpid()], set()
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
            continue
    return total / os.sysconf("SC_CLK_TCK")


def _timed(step, seconds: float) -> Tuple[float, float]:
    """Samples per second of ``step()`` (it returns how many samples it made), after a
    warm-up, and the CPU microseconds per sample of this process and its workers."""
    end = time.perf_counter() + WARMUP_S
    while time.perf_counter() < end:
        step()
    count, began, cpu = 0, time.perf_counter(), _cpu_s()
    end = began + seconds
    while True:
        count += step()
        now = time.perf_counter()
        if now >= end:
            return count / (now - began), (_cpu_s() - cpu) / count * 1e6


def reference(row: str, seconds: float) -> Tuple[float, float]:
    """One core: the callback, and its sample copied into a reused batch buffer."""
    from extsrc import SampleInfo

    nbytes, batch_size = ROWS[row]
    callback = CALLBACKS[row]
    batch = np.empty((batch_size, nbytes), np.uint8)
    flat = np.empty(2 * batch_size * nbytes, np.uint8)  # the ragged row's: samples one after another
    state = {"iteration": 0}

    def step() -> int:
        iteration = state["iteration"]
        offset = 0
        for k in range(batch_size):
            sample = callback(SampleInfo(iteration * batch_size + k, k, iteration, 0))
            if row == "ragged":
                flat[offset:offset + sample.nbytes] = sample
                offset += sample.nbytes
            else:
                batch[k] = sample
        state["iteration"] = iteration + 1
        return batch_size

    return _timed(step, seconds)


def reference_pair(row: str, seconds: float) -> Tuple[float, float]:
    """:func:`reference` in ``WORKERS`` processes at once: their rates summed, and their
    mean CPU microseconds per sample."""
    readers = []
    for _ in range(WORKERS):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            rate, cpu_us = reference(row, seconds)
            os.write(write_end, json.dumps([rate, cpu_us]).encode())
            os._exit(0)
        os.close(write_end)
        readers.append((pid, read_end))
    results = []
    for pid, read_end in readers:
        with os.fdopen(read_end, "rb") as f:
            results.append(json.loads(f.read()))
        os.waitpid(pid, 0)
    return sum(r for r, _ in results), statistics.mean(c for _, c in results)


def engine_small(seconds: float, dense_arrays: bool = False, prefetch: Optional[int] = None,
                 callback=small) -> Tuple[float, float]:
    import extsrc

    nbytes, batch_size = ROWS["small"]
    # A tree from before extsrc.Hooks took dense_arrays= itself (--tree compares with older ones).
    dense = ({"hooks": extsrc.Hooks(dense_arrays=True)} if hasattr(extsrc, "Hooks")
             else {"dense_arrays": True}) if dense_arrays else {}
    given = {} if prefetch is None else {"prefetch": prefetch}
    source = extsrc.ParallelSource(callback, batch_size, num_workers=WORKERS, start_method="fork",
                                   **dense, **given)
    try:
        batches = iter(source)

        def step() -> int:
            batch = next(batches)
            batch[0][0]  # the consumer touches one byte
            return batch_size

        return _timed(step, seconds)
    finally:
        source.close()


def engine_large(seconds: float) -> Tuple[float, float]:
    from extsrc import fn, pipeline_def

    nbytes, batch_size = ROWS["large"]

    @pipeline_def(batch_size=batch_size, num_threads=1, device_id=None, py_num_workers=WORKERS,
                  py_start_method="fork")
    def pipeline():
        samples = fn.external_source(source=large, batch=False, parallel=True)
        return samples[0:8]

    pipe = pipeline()
    pipe.build()

    def step() -> int:
        (output,) = pipe.run()
        len(output)
        return batch_size

    return _timed(step, seconds)  # the pipeline and its workers go with this process


def child(kind: str, row: str, seconds: float) -> None:
    if kind == "reference":
        rate, cpu_us = reference(row, seconds)
    elif kind == "pair":
        rate, cpu_us = reference_pair(row, seconds)
    else:
        rate, cpu_us = (engine_large(seconds) if row == "large"
                        else engine_small(seconds, dense_arrays=row == "small-arrays",
                                          prefetch=2 if row == "small-p2" else None,
                                          callback=CALLBACKS[row]))
    print(json.dumps({"rate": rate, "cpu_us": cpu_us}))


def run_child(tree: str, kind: str, row: str, seconds: float) -> Tuple[float, float]:
    """Samples per second, and CPU microseconds per sample (all of the run's processes)."""
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, row,
                           "--seconds", str(seconds)], env=env, capture_output=True, text=True,
                          timeout=120 + 4 * seconds, cwd=tree)
    if done.returncode:
        raise RuntimeError(f"{kind} {row} in {tree} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["rate"], result["cpu_us"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", help="a source tree to measure (repeatable; "
                        "default: the one this script is in)")
    parser.add_argument("--rows", default="small,small-p2,small-arrays,ragged,large",
                        help="comma-separated: small, small-p2, small-arrays, ragged, large (default: all)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time per run")
    parser.add_argument("--pair", action="store_true", help="also run the reference loop in "
                        "WORKERS processes at once and print the engine against their summed rate")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "ROW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.seconds)
        return 0
    trees = [os.path.abspath(t) for t in (args.tree or [os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))])]
    rows = [r for r in args.rows.split(",") if r]
    ratios: Dict[str, Dict[str, List[float]]] = {r: {t: [] for t in trees} for r in rows}
    rates: Dict[str, Dict[str, List[float]]] = {r: {t: [] for t in trees} for r in rows}
    cpu_shares: Dict[str, Dict[str, List[float]]] = {r: {t: [] for t in trees} for r in rows}
    pair_ratios: Dict[str, Dict[str, List[float]]] = {r: {t: [] for t in trees} for r in rows}
    for round_ in range(args.rounds):
        for row in rows:
            for tree in (trees if round_ % 2 == 0 else trees[::-1]):
                ref, ref_cpu = run_child(tree, "reference", row, args.seconds)
                eng, eng_cpu = run_child(tree, "engine", row, args.seconds)
                ratio = eng / (WORKERS * ref)
                ratios[row][tree].append(ratio)
                rates[row][tree].append(eng)
                cpu_shares[row][tree].append(ref_cpu / eng_cpu)
                pair = ""
                if args.pair:
                    both, _ = run_child(tree, "pair", row, args.seconds)
                    pair_ratios[row][tree].append(eng / both)
                    pair = (f"; {WORKERS} reference loops at once {both:,.0f}/s "
                            f"({both / (WORKERS * ref):.2f} of {WORKERS}x one), engine / that "
                            f"{eng / both:.3f}")
                load = os.getloadavg()[0]
                print(f"round {round_} {row:5s} {tree}: reference {ref:,.0f}/s per core, engine "
                      f"{eng:,.0f}/s, ratio {ratio:.3f}; CPU per sample {ref_cpu:.2f} us vs "
                      f"{eng_cpu:.2f} us{pair} (load {load:.1f})", flush=True)
    print()
    for row in rows:
        for tree in trees:
            r = sorted(ratios[row][tree])
            e = sorted(rates[row][tree])
            c = sorted(cpu_shares[row][tree])
            print(f"{row:5s} {tree}: ratio median {statistics.median(r):.3f} (range {r[0]:.3f}-"
                  f"{r[-1]:.3f}, {len(r)} runs); engine median {statistics.median(e):,.0f}/s; "
                  f"callback share of the engine's CPU median {statistics.median(c):.3f} "
                  f"(range {c[0]:.3f}-{c[-1]:.3f})")
            if args.pair:
                p = sorted(pair_ratios[row][tree])
                print(f"{row:5s} {tree}: engine / {WORKERS} reference loops at once, median "
                      f"{statistics.median(p):.3f} (range {p[0]:.3f}-{p[-1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
