"""Where the time goes: what a source measures while it runs, and what it concludes.

:class:`StatsCollector` belongs to one source. It is fed by:

* the workers, through each :class:`~extsrc.engine.protocol.TaskDone`: how
  long the task took in the worker (``busy_ns``) and how long the callback
  took for its samples (``timed``: ``(samples, ns)`` per group of samples
  written together: one sample when samples are large, the whole task when
  they are small, so that timing costs nothing per sample);
* the pool's I/O thread (:meth:`StatsCollector.task_done`), lock held;
* the consumer thread (:meth:`StatsCollector.took`), lock held: the time it
  waited in ``next()`` for a batch, and how many batches were ready then;
* the kernel's scheduler statistics (``/proc/<pid>/task/<tid>/schedstat``),
  read at the start and end of a window: the CPU time the workers and the
  consumer got, and how long they were runnable but waiting for a CPU. On a
  machine loaded by other programs the other figures (the time spent in
  ``next()``, the workers' busy time) include that wait, and the diagnosis
  says so instead of blaming either side.

:meth:`StatsCollector.snapshot` makes a :class:`SourceStats`, a frozen record
whose ``str()`` is a short report ending in a diagnosis from the figures.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
import os
import threading
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from extsrc.arrays import Array
from extsrc.shm.limits import format_bytes

# Groups of callback timings kept for the percentiles (the most recent ones), in arrays made
# once: collecting allocates nothing while the source runs.
TIMINGS_KEPT = 4096
# The consumer waiting for this fraction of its time or more: the input is the bottleneck.
INPUT_BOUND_WAIT = 0.10
# Workers busy this fraction of the wall time or more: they are at their limit.
WORKERS_SATURATED = 0.85
# The workers (on average) or the consumer thread runnable but waiting for a CPU this fraction of
# the wall time or more: the CPU they needed was not there, and the other figures are skewed by it.
CPU_WAIT_BUSY = 0.10
# While they waited, other programs used at least this fraction of the cores the process may run
# on (what the kernel counts busy on them, /proc/stat, minus what the source's own processes
# used; without /proc/stat, the cores minus that): the machine is busy, rather than the workers
# and the consumer (or a worker's own threads, concurrency=N) crowding each other out.
OTHERS_SHARE = 0.25
# Busy workers that spend this share of their busy time or more neither on a CPU nor waiting
# for one mostly wait on storage or the network: more samples in flight per worker is the fix,
# not more workers (which a machine short of CPU would not run anyway).
WAITING_SHARE = 0.5
# ... provided the workers have work most of the time (else they wait for tasks, not storage).
WAITING_BUSY = 0.5
# On a busy machine, workers that waited on I/O at least this many times as long as for a CPU
# (both of the wall time) still get that advice: other programs do not lengthen a wait on
# storage or the network, and overlapping those waits is what gains most. (A callback sleeping
# 20 ms a sample beside 4 CPU hogs and another test run on 2 cores: 16% of the time waiting for
# a CPU, 83% on I/O; 10% as a fixed line for the CPU wait failed there.)
IO_OVER_CPU_WAIT = 2.0
# The concurrency the diagnosis suggests grows by at most this factor at a time (the CPU share
# is a coarse figure, and a server has its own limit).
CONCURRENCY_STEP_MAX = 16


@dataclass(frozen=True)
class SourceStats:
    """What a source did over ``seconds`` of wall time (see the module docstring).

    Figures: batches, samples and bytes handed to the consumer; the time the
    consumer waited in ``next()`` (total and fraction of the wall time); each
    worker's busy fraction; the callback's time per sample (median, 95th
    percentile, max; over groups of small samples, per sample for large
    ones); how many finished batches were waiting, on average, when the
    consumer took one (``ready_ahead``), and now; the shared memory in use.
    """

    name: str
    seconds: float
    batches: int
    samples: int
    bytes: int
    wait_seconds: float
    start_wait_seconds: float  # of wait_seconds: waiting for the first batch of an epoch
    worker_busy: Tuple[float, ...]
    callback_median_s: Optional[float]
    callback_p95_s: Optional[float]
    callback_max_s: Optional[float]
    ready_ahead: float
    ready_now: int
    shared_memory_bytes: int
    num_workers: int
    prefetch: int
    batch_size: int
    # From the scheduler (None/empty where it cannot be read, e.g. Ray actors on other hosts):
    workers_cpu_wait: Tuple[float, ...] = ()  # per worker: runnable but not running, of the time
    consumer_cpu_wait: Optional[float] = None  # the same for the thread taking the batches
    own_cpu_cores: Optional[float] = None  # cores used by this process and its workers, on average
    cores: int = 0  # cores this process may run on
    idle_cores: Optional[float] = None  # of those, how many were idle on average (/proc/stat)
    concurrency: int = 1  # samples in flight at once per worker, at most (the source's setting)
    in_flight_mean: float = 0.0  # samples in flight per worker on average while it was busy
    worker_cpu_share: Optional[float] = None  # CPU time of the workers / their busy time
    worker_runq_share: Optional[float] = None  # their time waiting for a CPU / their busy time
    skipped: int = 0  # samples the callback failed on and on_error="skip" left out, since start
    replaced: int = 0  # the same, replaced by on_error(info, error) (ParallelSource.faults())
    worker_restarts: int = 0  # lost workers of its pool replaced since the start (pool.restarts)

    @property
    def waiting_share(self) -> Optional[float]:
        """The share of the workers' busy time spent neither on a CPU nor waiting for one:
        waiting on I/O (storage, network, sleep). None when not measured."""
        if self.worker_cpu_share is None:
            return None
        return max(0.0, 1.0 - self.worker_cpu_share - (self.worker_runq_share or 0.0))

    def _busy_time_text(self) -> str:
        """How the workers' busy time went: on a CPU, waiting for one, waiting on I/O; the CPU
        time of several threads (``concurrency=``, a library's own threads) as CPUs."""
        cpu, waiting = self.worker_cpu_share, self.waiting_share
        if cpu is None or waiting is None:
            return "n/a"
        on_cpu = f"{cpu:.0%} on a CPU" if cpu <= 1.0 else f"on {cpu:.1f} CPUs at once (several threads)"
        return f"{on_cpu}, {self.worker_runq_share or 0:.0%} waiting for one, {waiting:.0%} waiting on I/O"

    @property
    def wait_fraction(self) -> float:
        """The fraction of the wall time the consumer spent waiting for batches."""
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def steady_wait_fraction(self) -> float:
        """The fraction of the time the consumer waited, leaving out the first batch of each
        epoch (start-up, and the refill after an epoch's end): what the diagnosis goes by."""
        steady = self.seconds - self.start_wait_seconds
        return (self.wait_seconds - self.start_wait_seconds) / steady if steady > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_worker_busy(self) -> float:
        return sum(self.worker_busy) / len(self.worker_busy) if self.worker_busy else 0.0

    @property
    def input_bound(self) -> bool:
        """Whether the consumer waits for the input: it spends time in ``next()`` and batches
        were seldom ready when it came (time in ``next()`` while batches were ready is the cost
        of taking them, or a consumer thread without a CPU, not a wait for the workers)."""
        return self.steady_wait_fraction >= INPUT_BOUND_WAIT and self.ready_ahead < 1

    @property
    def mean_worker_cpu_wait(self) -> Optional[float]:
        if not self.workers_cpu_wait:
            return None
        return sum(self.workers_cpu_wait) / len(self.workers_cpu_wait)

    @property
    def machine_busy(self) -> bool:
        """Whether the workers or the consumer waited for a CPU (:data:`CPU_WAIT_BUSY`) while
        other programs took the cores (:data:`OTHERS_SHARE`): the figures then tell about the
        machine, not about the source."""
        waits = [w for w in (self.mean_worker_cpu_wait, self.consumer_cpu_wait) if w is not None]
        if not waits or max(waits) < CPU_WAIT_BUSY or self.others_cores is None or not self.cores:
            return False
        return self.others_cores >= OTHERS_SHARE * self.cores

    @property
    def _waits_on_io_despite_busy_machine(self) -> bool:
        """Input-bound workers that waited on I/O :data:`IO_OVER_CPU_WAIT` times as long as for
        a CPU, or longer: other programs on the cores do not slow a wait on storage or the
        network, so the advice to keep more samples in flight holds on a busy machine too."""
        cpu_wait, waiting = self.mean_worker_cpu_wait, self.waiting_share
        if cpu_wait is None or waiting is None or not self.input_bound:
            return False
        io_wait = waiting * self.mean_worker_busy  # of the wall time, as cpu_wait is
        return io_wait >= IO_OVER_CPU_WAIT * cpu_wait and self._waiting_advice() is not None

    @property
    def others_cores(self) -> Optional[float]:
        """Cores used on average by other programs, of those this process may run on."""
        if self.own_cpu_cores is None:
            return None
        idle = self.idle_cores if self.idle_cores is not None else 0.0
        return max(0.0, self.cores - idle - self.own_cpu_cores)

    @property
    def kind(self) -> str:
        """The diagnosis in one word: ``"none"`` (no batch yet), ``"machine busy"``,
        ``"input-bound"``, ``"per-batch cost"``, ``"consumer-bound"`` or ``"balanced"``."""
        if self.batches == 0:
            return "none"
        if self.machine_busy and not self._waits_on_io_despite_busy_machine:
            return "machine busy"
        if self.input_bound:
            return "input-bound"
        if self.steady_wait_fraction >= INPUT_BOUND_WAIT:
            return "per-batch cost"
        if self.ready_ahead >= 1:
            return "consumer-bound"
        return "balanced"

    def diagnosis(self) -> str:
        """Which side is the bottleneck, and what to change, in plain words, from the figures.

        Never advises a setting the source already has.
        """
        wait, busy, kind = self.steady_wait_fraction, self.mean_worker_busy, self.kind
        workers = "The worker is" if self.num_workers == 1 else f"The {self.num_workers} workers are"
        if kind == "none":
            return "No batch was taken yet: nothing to tell."
        if kind == "machine busy":
            waited = []
            if self.mean_worker_cpu_wait is not None:
                waited.append(f"the workers {self.mean_worker_cpu_wait:.0%}")
            if self.consumer_cpu_wait is not None:
                waited.append(f"the consumer {self.consumer_cpu_wait:.0%}")
            assert self.own_cpu_cores is not None and self.others_cores is not None
            others = ("" if self.idle_cores is None else
                      f" and other programs {self.others_cores:.1f}")
            return (
                f"Machine busy: other programs use the cores. Ready to run, {' and '.join(waited)} "
                f"of the time waited for a CPU, while this source's processes used "
                f"{self.own_cpu_cores:.1f}{others} of the {_cores_text(self.cores)} they may run on. The waits and "
                "busy times above include that lost CPU time, so they blame neither the workers "
                "nor the consumer; no setting of the source fixes it. Run on free cores (fewer "
                "other jobs, taskset/cpuset), then look again."
            )
        if kind == "input-bound":
            head = f"Input-bound: the consumer waited {wait:.0%} of the time for batches. "
            waiting = self._waiting_advice()
            if waiting is not None and self.machine_busy:
                return head + waiting + (
                    f" (Other programs also used {self.others_cores:.1f} of the "
                    f"{_cores_text(self.cores)}; the workers waited on I/O far longer than for a "
                    "CPU.)")
            if waiting is not None:
                return head + waiting
            if busy >= WORKERS_SATURATED:
                per_worker = 1 / self.callback_median_s if self.callback_median_s else None
                rate = f" (about {per_worker:,.0f} samples/s per worker)" if per_worker else ""
                return head + (
                    f"{workers} busy {busy:.0%} of the time{rate}: add "
                    f"workers (num_workers={self.num_workers + max(1, self.num_workers // 2)}) "
                    "if the machine has idle cores, or make the callback cheaper."
                )
            return head + (
                f"Yet the workers are busy only {busy:.0%} of the time: they wait for work, so the "
                f"cost per batch on the consumer's side dominates. Take larger batches "
                f"(batch_size={self.batch_size * 2}) or keep more ahead (prefetch={self.prefetch * 2})."
            )
        if kind == "per-batch cost":
            return (
                f"Per-batch cost: batches were ready when taken ({self.ready_ahead:.1f} on "
                f"average), so the input keeps up, yet taking them (next()) was {wait:.0%} of the "
                f"time: the consumer's loop does little per batch. Take larger batches "
                f"(batch_size={self.batch_size * 2}) so that the cost of a batch is paid less often."
            )
        if kind == "consumer-bound":
            text = (
                f"Consumer-bound: batches were ready ahead ({self.ready_ahead:.1f} on average) and "
                f"the consumer waited only {wait:.0%} of the time: the time goes into the consumer's "
                f"own work. The input keeps up with {busy:.0%} busy workers"
            )
            enough = max(1, math.ceil(self.num_workers * busy / WORKERS_SATURATED))
            if enough < self.num_workers:
                return text + f"; fewer workers (num_workers={enough}) would do."
            return text + "; more workers would not help, only a faster consumer."
        return (
            f"Balanced: the consumer waited {wait:.0%} of the time and batches were seldom ready "
            f"ahead ({self.ready_ahead:.1f} on average); raise prefetch (now {self.prefetch}, try "
            f"prefetch={self.prefetch * 2}) to absorb jitter, or add a worker "
            f"(num_workers={self.num_workers + 1}) to get ahead."
        )

    def _waiting_advice(self) -> Optional[str]:
        """When busy workers mostly wait rather than compute: more concurrency is the fix."""
        busy, waiting = self.mean_worker_busy, self.waiting_share
        if waiting is None or busy < WAITING_BUSY or waiting < WAITING_SHARE:
            return None
        step = min(CONCURRENCY_STEP_MAX, max(2, math.ceil(1 / max(1 - waiting, 1e-3))))
        suggested = self.concurrency * step
        used = ""
        if self.concurrency > 1 and self.in_flight_mean < self.concurrency / 2:
            used = (f" Only {self.in_flight_mean:.1f} of concurrency={self.concurrency} samples were "
                    f"in flight on average: a worker's task holds too few samples; take larger "
                    f"batches (batch_size={self.batch_size * 2}).")
            return (f"The workers are busy {busy:.0%} of the time and wait on I/O for {waiting:.0%} "
                    f"of it (storage, network).{used}")
        return (
            f"The workers are busy {busy:.0%} of the time and wait on I/O for {waiting:.0%} of it "
            f"(storage, network), {self.in_flight_mean:.1f} samples in "
            f"flight per worker. More samples in flight, not more workers: "
            f"concurrency={suggested} (an async def callback, or threads for a blocking one)."
        )

    def __str__(self) -> str:
        def ms(value: Optional[float]) -> str:
            if value is None:
                return "n/a"
            if value >= 1:
                return f"{value:.3g} s"
            return f"{value * 1e3:.3g} ms" if value >= 1e-3 else f"{value * 1e6:.3g} µs"

        busy = ", ".join(f"{b:.0%}" for b in self.worker_busy) or "n/a"
        lines = [
            f"extsrc source {self.name}: {self.batches} batches, {self.samples} samples, "
            f"{format_bytes(self.bytes)} in {self.seconds:.1f} s ({self.samples_per_s:,.0f} samples/s)",
            f"  consumer waited {self.wait_seconds:.2f} s ({self.wait_fraction:.0%} of the time; "
            f"{self.steady_wait_fraction:.0%} leaving out {self.start_wait_seconds:.2f} s for the "
            f"first batches of epochs); batches ready when taken: {self.ready_ahead:.1f} on "
            f"average, {self.ready_now} now",
            f"  workers busy: {busy}",
            f"  callback per sample: median {ms(self.callback_median_s)}, p95 "
            f"{ms(self.callback_p95_s)}, max {ms(self.callback_max_s)}",
            f"  in flight per worker: {self.in_flight_mean:.1f} samples on average (concurrency="
            f"{self.concurrency}); of the workers' busy time: "
            + self._busy_time_text(),
            f"  shared memory: {format_bytes(self.shared_memory_bytes)}",
        ]
        if self.worker_restarts:
            lines.append(f"  workers lost and replaced: {self.worker_restarts} (pool.restarts says how)")
        if self.skipped or self.replaced:
            lines.append(f"  samples the callback failed on: {self.skipped} skipped, {self.replaced} "
                         "replaced since the start (source.faults() lists them)")
        if self.own_cpu_cores is not None:
            waits = ", ".join(f"{w:.0%}" for w in self.workers_cpu_wait) or "n/a"
            consumer = "n/a" if self.consumer_cpu_wait is None else f"{self.consumer_cpu_wait:.0%}"
            others = "" if self.idle_cores is None else f", {self.others_cores:.1f} by other programs"
            lines.append(
                f"  CPU: {self.own_cpu_cores:.1f} of {_cores_text(self.cores)} used by the consumer and "
                f"workers{others}; waiting for a CPU while runnable: workers {waits}, consumer {consumer}"
            )
        lines.append(f"  diagnosis: {self.diagnosis()}")
        return "\n".join(lines)


def _cores_text(cores: int) -> str:
    return "1 core" if cores == 1 else f"{cores} cores"


Sched = Tuple[int, int]  # (ns on a CPU, ns runnable but waiting for one), from schedstat


def _read_sched(path: str) -> Optional[Sched]:
    try:
        with open(path) as f:
            fields = f.read().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


def _process_sched(pid: int) -> Optional[Sched]:
    """The CPU time and run-queue wait of all threads of process ``pid`` (None: unreadable)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    cpu = delay = 0
    found = False
    for tid in tids:
        figures = _read_sched(f"/proc/{pid}/task/{tid}/schedstat")
        if figures is not None:
            cpu, delay, found = cpu + figures[0], delay + figures[1], True
    return (cpu, delay) if found else None


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _idle_ticks() -> Optional[int]:
    """Clock ticks the CPUs this process may run on have spent idle (idle and iowait, from
    ``/proc/stat``) since boot; None where it cannot be read."""
    try:
        allowed = {f"cpu{n}" for n in os.sched_getaffinity(0)}
        total, found = 0, False
        with open("/proc/stat") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] in allowed:
                    total += int(fields[4]) + int(fields[5])  # idle, iowait
                    found = True
        return total if found else None
    except (AttributeError, OSError, ValueError, IndexError):
        return None


class SchedWindow:
    """What the scheduler says about the source's processes over a window (Linux ``schedstat``).

    Read at the start of the window (:meth:`start`) and when figures are
    asked for (:meth:`figures`): per worker, the process's CPU time and
    run-queue wait (all its threads); for the consumer, the wait of the
    thread that takes the batches and the CPU time of the whole process.
    Processes or threads that came or went during the window are left out.
    """

    def __init__(self, worker_pids: Optional[Callable[[], List[int]]]):
        self.worker_pids = worker_pids
        self.consumer_tid = threading.get_native_id()
        self._base: Dict[object, Sched] = {}
        self._idle_base: Optional[int] = None

    def _now(self) -> Dict[object, Sched]:
        now: Dict[object, Sched] = {}
        pid = os.getpid()
        for key, figures in (("process", _process_sched(pid)),
                             ("consumer", _read_sched(f"/proc/{pid}/task/{self.consumer_tid}/schedstat"))):
            if figures is not None:
                now[key] = figures
        for index, worker in enumerate(self.worker_pids() if self.worker_pids is not None else ()):
            figures = _process_sched(worker)
            if figures is not None:
                now[("worker", index, worker)] = figures
        return now

    def start(self) -> None:
        self.consumer_tid = threading.get_native_id()
        self._base = self._now()
        self._idle_base = _idle_ticks()

    def idle_cores(self, seconds: float) -> Optional[float]:
        """Cores of this process's set idle on average since :meth:`start` (None: unknown)."""
        now = _idle_ticks()
        if now is None or self._idle_base is None or seconds <= 0:
            return None
        return max(0.0, (now - self._idle_base) / os.sysconf("SC_CLK_TCK") / seconds)

    def figures(self, seconds: float, num_workers: int
                ) -> Tuple[Tuple[float, ...], Optional[float], Optional[float], int]:
        """``(workers' wait, consumer's wait, cores used, cores)``: waits as fractions of
        ``seconds``; ``((), None, None, cores)`` where the scheduler cannot be read."""
        now, base = self._now(), self._base
        delta = {key: (now[key][0] - base[key][0], now[key][1] - base[key][1])
                 for key in now if key in base}
        cores = usable_cpus()
        if "process" not in delta:
            return (), None, None, cores
        workers = sorted((key, figures) for key, figures in delta.items()
                         if isinstance(key, tuple))
        waits = tuple(min(1.0, d * 1e-9 / seconds) for _, (_, d) in workers)
        used = (delta["process"][0] + sum(c for _, (c, _) in workers)) * 1e-9 / seconds
        consumer = delta.get("consumer")
        return (waits if len(waits) == num_workers else (),
                None if consumer is None else min(1.0, consumer[1] * 1e-9 / seconds), used, cores)


class StatsCollector:
    """The figures of one source as they come (see the module docstring).

    ``worker_pids``: the pids of the workers, by worker index, for the
    scheduler's figures (``None``: workers not on this host); ``concurrency``:
    the source's samples in flight per worker.
    """

    def __init__(self, num_workers: int, worker_pids: Optional[Callable[[], List[int]]] = None,
                 concurrency: int = 1):
        self.num_workers = num_workers
        self.concurrency = concurrency
        self.sched = SchedWindow(worker_pids)
        self.reset()

    def reset(self) -> None:
        """Starts a new window: every figure from zero. Called by the consumer thread."""
        self.sched.start()
        self.started = time.monotonic()
        self.batches = 0
        self.samples = 0
        self.bytes = 0
        self.wait_ns = 0
        self.start_wait_ns = 0
        self.ready_sum = 0
        self.busy_ns: List[int] = [0] * self.num_workers
        self.per_sample = np.zeros(TIMINGS_KEPT)  # seconds per sample of each group, a ring
        self.weight = np.zeros(TIMINGS_KEPT, np.int64)  # samples in each group
        self.timed = 0  # groups recorded so far
        self.longest = 0.0
        self.waited_ns = 0  # samples' time in flight, summed
        self.cpu_ns = 0  # workers' CPU time over the tasks that measured it
        self.runq_ns = 0  # their time waiting for a CPU
        self.cpu_busy_ns = 0  # the busy time of those tasks
        self.last_cpu: List[Optional[Tuple[int, int]]] = [None] * self.num_workers  # cumulative
        self.busy_since_cpu: List[int] = [0] * self.num_workers  # busy ns since that reading

    def task_done(self, worker: int, busy_ns: int, timed: Tuple[Tuple[int, int], ...],
                  waited_ns: int = 0, cpu_ns: int = -1, runq_ns: int = -1) -> None:
        """A task of the source reported back (I/O thread, lock held); ``cpu_ns``/``runq_ns``
        are the worker's cumulative counters (-1: not read with this task)."""
        self.busy_ns[worker] += busy_ns
        self.waited_ns += waited_ns
        self.busy_since_cpu[worker] += busy_ns
        if cpu_ns >= 0:  # a reading (workers read their counters every so often, not per task)
            last = self.last_cpu[worker]
            if last is not None:  # the window counts from a worker's second reading on
                self.cpu_ns += cpu_ns - last[0]
                self.runq_ns += max(0, runq_ns - last[1])
                self.cpu_busy_ns += self.busy_since_cpu[worker]
            self.last_cpu[worker] = (cpu_ns, runq_ns)
            self.busy_since_cpu[worker] = 0
        for samples, ns in timed:
            per_sample = ns / samples * 1e-9
            k = self.timed % TIMINGS_KEPT
            self.per_sample[k], self.weight[k] = per_sample, samples
            self.timed += 1
            if per_sample > self.longest:
                self.longest = per_sample

    def took(self, samples: int, nbytes: int, wait_ns: int, ready: int, first: bool) -> None:
        """The consumer took a batch after waiting ``wait_ns``; ``ready`` others were finished
        then; ``first``: the first batch of an epoch."""
        self.batches += 1
        self.samples += samples
        self.bytes += nbytes
        self.wait_ns += wait_ns
        if first:
            self.start_wait_ns += wait_ns
        self.ready_sum += ready

    def snapshot(self, name: str, ready_now: int, shared_memory: int, prefetch: int,
                 batch_size: int) -> SourceStats:
        seconds = max(time.monotonic() - self.started, 1e-9)
        workers_wait, consumer_wait, used, cores = self.sched.figures(seconds, self.num_workers)
        idle = self.sched.idle_cores(seconds) if used is not None else None
        kept = min(self.timed, TIMINGS_KEPT)
        median, p95 = _weighted_percentiles(self.per_sample[:kept], self.weight[:kept], (0.5, 0.95))
        return SourceStats(
            name=name, seconds=seconds, batches=self.batches, samples=self.samples,
            bytes=self.bytes, wait_seconds=self.wait_ns * 1e-9,
            start_wait_seconds=self.start_wait_ns * 1e-9,
            worker_busy=tuple(min(1.0, ns * 1e-9 / seconds) for ns in self.busy_ns),
            callback_median_s=median, callback_p95_s=p95,
            callback_max_s=self.longest if self.timed else None,
            ready_ahead=self.ready_sum / self.batches if self.batches else 0.0,
            ready_now=ready_now, shared_memory_bytes=shared_memory, num_workers=self.num_workers,
            prefetch=prefetch, batch_size=batch_size, workers_cpu_wait=workers_wait,
            consumer_cpu_wait=consumer_wait, own_cpu_cores=used, cores=cores, idle_cores=idle,
            concurrency=self.concurrency,
            in_flight_mean=self.waited_ns / max(1, sum(self.busy_ns)),
            worker_cpu_share=self.cpu_ns / self.cpu_busy_ns if self.cpu_busy_ns else None,
            worker_runq_share=self.runq_ns / self.cpu_busy_ns if self.cpu_busy_ns else None,
        )


def publish(stats: SourceStats) -> None:
    """Shows a periodic report (``stats_every=``) to the user.

    To the ``extsrc`` logger at INFO when logging is set up (a handler on it
    or on an ancestor: the user's configuration decides, also to keep it
    quiet); else straight to stderr, since an unconfigured logger would drop
    INFO records and the report would reach nobody.
    """
    logger = logging.getLogger("extsrc")
    if logger.hasHandlers():
        logger.info("%s", stats)
    else:
        print(stats, file=sys.stderr, flush=True)


def _weighted_percentiles(values: Array, weights: Array,
                          quantiles: Tuple[float, ...]) -> Tuple[Optional[float], ...]:
    """Percentiles of ``values``, each standing for ``weights`` samples."""
    if not len(values):
        return tuple(None for _ in quantiles)
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    total = cumulative[-1]
    return tuple(float(values[order[min(int(np.searchsorted(cumulative, q * total)), len(order) - 1)]])
                 for q in quantiles)
