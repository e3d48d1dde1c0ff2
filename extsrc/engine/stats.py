"""Where the time goes: what a source measures while it runs, and what it concludes.

:class:`StatsCollector` belongs to one source. It is fed by:

* the workers, through each :class:`~extsrc.engine.protocol.TaskDone`: how
  long the task took in the worker (``busy_ns``) and how long the callback
  took for its samples (``timed``: ``(samples, ns)`` per group of samples
  written together: one sample when samples are large, the whole task when
  they are small, so that timing costs nothing per sample);
* the pool's I/O thread (:meth:`StatsCollector.task_done`), lock held;
* the consumer thread (:meth:`StatsCollector.took`), lock held: the time it
  waited in ``next()`` for a batch, and how many batches were ready then.

:meth:`StatsCollector.snapshot` makes a :class:`SourceStats`, a frozen record
whose ``str()`` is a short report ending in a diagnosis from the figures.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from extsrc.shm.limits import format_bytes

# Groups of callback timings kept for the percentiles (the most recent ones), in arrays made
# once: collecting allocates nothing while the source runs.
TIMINGS_KEPT = 4096
# The consumer waiting for this fraction of its time or more: the input is the bottleneck.
INPUT_BOUND_WAIT = 0.10
# Workers busy this fraction of the wall time or more: they are at their limit.
WORKERS_SATURATED = 0.85
# Busy workers that spend this share of their busy time or more neither on a CPU nor waiting
# for one mostly wait on storage or the network: more samples in flight per worker is the fix,
# not more workers (which a machine short of CPU would not run anyway).
WAITING_SHARE = 0.5
# ... provided the workers have work most of the time (else they wait for tasks, not storage).
WAITING_BUSY = 0.5
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
    concurrency: int = 1  # samples in flight at once per worker, at most (the source's setting)
    in_flight_mean: float = 0.0  # samples in flight per worker on average while it was busy
    worker_cpu_share: Optional[float] = None  # CPU time of the workers / their busy time
    worker_runq_share: Optional[float] = None  # their time waiting for a CPU / their busy time

    @property
    def waiting_share(self) -> Optional[float]:
        """The share of the workers' busy time spent neither on a CPU nor waiting for one:
        waiting on I/O (storage, network, sleep). None when not measured."""
        if self.worker_cpu_share is None:
            return None
        return max(0.0, 1.0 - self.worker_cpu_share - (self.worker_runq_share or 0.0))

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
        """Whether the consumer waits for the input (else the consumer is the bottleneck)."""
        return self.steady_wait_fraction >= INPUT_BOUND_WAIT

    def diagnosis(self) -> str:
        """Which side is the bottleneck, and what to change, in plain words, from the figures."""
        wait, busy = self.steady_wait_fraction, self.mean_worker_busy
        if self.batches == 0:
            return "No batch was taken yet: nothing to tell."
        if self.input_bound:
            head = (f"Input-bound: the consumer waited {wait:.0%} of the time for batches. ")
            waiting = self._waiting_advice()
            if waiting is not None:
                return head + waiting
            if busy >= WORKERS_SATURATED:
                per_worker = 1 / self.callback_median_s if self.callback_median_s else None
                rate = f" (about {per_worker:,.0f} samples/s per worker)" if per_worker else ""
                workers = "The worker is" if self.num_workers == 1 else f"The {self.num_workers} workers are"
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
        if self.ready_ahead >= 1:
            return (
                f"Consumer-bound: batches were ready ahead ({self.ready_ahead:.1f} on average) and "
                f"the consumer waited only {wait:.0%} of the time: the time goes into the consumer's "
                f"own work. The input keeps up with {busy:.0%} busy workers; fewer workers "
                f"(num_workers={max(1, math.ceil(self.num_workers * busy / WORKERS_SATURATED))}) "
                "would do."
            )
        return (
            f"Balanced: the consumer waited {wait:.0%} of the time and batches were seldom ready "
            f"ahead ({self.ready_ahead:.1f} on average); raise prefetch (now {self.prefetch}) to "
            "absorb jitter, or add a worker to get ahead."
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
            + ("n/a" if self.waiting_share is None else
               f"{self.worker_cpu_share:.0%} on a CPU, {self.worker_runq_share or 0:.0%} waiting for "
               f"one, {self.waiting_share:.0%} waiting on I/O"),
            f"  shared memory: {format_bytes(self.shared_memory_bytes)}",
            f"  diagnosis: {self.diagnosis()}",
        ]
        return "\n".join(lines)


class StatsCollector:
    """The figures of one source as they come (see the module docstring)."""

    def __init__(self, num_workers: int, concurrency: int = 1):
        self.num_workers = num_workers
        self.concurrency = concurrency
        self.reset()

    def reset(self) -> None:
        """Starts a new window: every figure from zero."""
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
            prefetch=prefetch, batch_size=batch_size, concurrency=self.concurrency,
            in_flight_mean=self.waited_ns / max(1, sum(self.busy_ns)),
            worker_cpu_share=self.cpu_ns / self.cpu_busy_ns if self.cpu_busy_ns else None,
            worker_runq_share=self.runq_ns / self.cpu_busy_ns if self.cpu_busy_ns else None,
        )


def _weighted_percentiles(values: np.ndarray, weights: np.ndarray,
                          quantiles: Tuple[float, ...]) -> Tuple[Optional[float], ...]:
    """Percentiles of ``values``, each standing for ``weights`` samples."""
    if not len(values):
        return tuple(None for _ in quantiles)
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    total = cumulative[-1]
    return tuple(float(values[order[min(int(np.searchsorted(cumulative, q * total)), len(order) - 1)]])
                 for q in quantiles)
