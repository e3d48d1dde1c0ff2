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

import logging
import math
import sys
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
            f"  shared memory: {format_bytes(self.shared_memory_bytes)}",
            f"  diagnosis: {self.diagnosis()}",
        ]
        return "\n".join(lines)


class StatsCollector:
    """The figures of one source as they come (see the module docstring)."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
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

    def task_done(self, worker: int, busy_ns: int, timed: Tuple[Tuple[int, int], ...]) -> None:
        """A task of the source reported back (I/O thread, lock held)."""
        self.busy_ns[worker] += busy_ns
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
            prefetch=prefetch, batch_size=batch_size,
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
