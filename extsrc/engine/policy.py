"""The engine's tuning, in one place: how deep, how far ahead, when to defer, which copy.

Every number the engine was tuned with lives here, with why it is what it
is and what it was measured to do; the code that uses them asks the
functions below instead of doing the arithmetic itself. Measurements are
from the project's 2-core machine (``benchmarks/ceiling.py``, 1 KiB samples
with batch 256, or 4 MiB samples with batch 16, 2 workers, fork) unless
said otherwise. Change a number here, then measure the change against the
commit before (CONTRIBUTING.md).

Nothing here is a promise to users but what the documentation states: the
widened prefetch takes at most :data:`SMALL_AHEAD_BYTES`, a quarter of the
descriptors and a quarter of the memory left.
"""

from __future__ import annotations

import math
from typing import Optional

# -- how deep: tasks a worker holds ------------------------------------------------------------

# Tasks a worker process holds: one running, one waiting, so a worker never waits for the
# pool's process between two tasks (PyTorch's DataLoader keeps two per worker as well).
MAX_OUTSTANDING = 2
# A worker whose tasks are short holds enough of them to run this long without the pool's
# I/O thread, which then need not preempt a worker when it wakes up (see defer_wake_ups): it
# may wait for a CPU up to a scheduler time slice (0.75-3 ms on Linux) before it sends more.
# Measured on the 1 KiB workload: the pool's process took 45-55 us of CPU per batch instead
# of 100-115, and the engine made about 20% more samples/s.
QUEUE_COVER_S = 0.004
# However short its tasks, a worker holds at most this many: each holds a slot's memory, and
# a worker that dies fails every task it holds.
SHORT_TASK_DEPTH = 8
# The weight of a source's newest task in the moving average of its tasks' time.
TASK_TIME_WEIGHT = 0.25


def task_seconds(average: float, took: float) -> float:
    """The moving average of a source's task time after a task that took ``took`` seconds
    (``average`` 0.0: none timed yet)."""
    return took if not average else average + TASK_TIME_WEIGHT * (took - average)


def task_depth(average: float, base: int) -> int:
    """How many of a source's tasks a worker may hold, its tasks taking ``average`` seconds:
    the backend's ``base`` (its ``max_outstanding``), or for short tasks enough to run
    :data:`QUEUE_COVER_S`, at most :data:`SHORT_TASK_DEPTH`. Timed per source: on a shared
    pool, one source's short tasks must not let another's long ones queue deep in a worker."""
    if not average:
        return base
    return max(base, min(SHORT_TASK_DEPTH, math.ceil(QUEUE_COVER_S / average)))


# -- when to defer: the I/O thread's wake-ups --------------------------------------------------


def defer_wake_ups(held: int, depth: int, base: int, deferring: bool) -> bool:
    """Whether the pool's I/O thread may wait for a free CPU when woken rather than preempt a
    worker (``threads.defer_on_wake_up``), as far as one worker is concerned: it holds ``held``
    tasks, all short, the shortest of them allowing ``depth``. It must hold as many as it may
    to begin deferring, and half of them to go on: without that hysteresis the thread switched
    about 480 times a second and gave back most of the gain. Long tasks never defer (deferring
    made the 4 MiB row slower)."""
    if held <= base or depth <= base:
        return False
    return held >= depth or (deferring and 2 * held >= depth)


# -- how far ahead: the prefetch ---------------------------------------------------------------

# With samples in flight together (concurrency > 1), the default prefetch is this many times
# larger: a batch is finished only when its slowest request is, and batches waiting for their
# last samples would otherwise take every place ahead while the workers' free places for
# requests stay empty (measured: 100 KiB objects with 20 ms to first byte, batch 64,
# 2 workers, concurrency=64: about 10% more samples/s with twice the batches ahead).
CONCURRENT_PREFETCH_FACTOR = 2
# With the default prefetch, batches of at most SMALL_BATCH_BYTES whose tasks are short go
# ahead SMALL_BATCH_PREFETCH_FACTOR times as far: such a batch takes a worker well under a
# scheduler's time slice to make, so a consumer or an I/O thread that waits that long for a
# CPU would otherwise find every slot taken and the workers idle. Measured on the 1 KiB
# workload: twice as far ahead gave 5-8% more samples/s than once, six times about 10% more
# than twice.
SMALL_BATCH_BYTES = 1 << 20
SMALL_BATCH_PREFETCH_FACTOR = 6
# The extra batches take at most this much memory, whatever the number of workers...
SMALL_AHEAD_BYTES = 32 << 20
# ... at most 1/SMALL_AHEAD_FD_SHARE of the descriptors the process may open (a slot holds
# 1 + num_workers of them while it is in the pool; under `ulimit -n 64`, 26 slots of 3
# descriptors each left a consumer that keeps its batches none to open) ...
SMALL_AHEAD_FD_SHARE = 4
# ... and at most 1/SMALL_AHEAD_ROOM_SHARE of the memory and address space left under the
# process's limits (the consumer maps each slot; under `ulimit -v` the widening alone left the
# consumer's own next batch no address space).
SMALL_AHEAD_ROOM_SHARE = 4


def default_prefetch(num_workers: int, tasks_per_worker: int = MAX_OUTSTANDING,
                     concurrency: int = 1) -> int:
    """Batches produced ahead by default: as many per worker as a worker holds tasks, so that
    each batch can be one task and every worker still has a task queued;
    :data:`CONCURRENT_PREFETCH_FACTOR` times that for samples in flight together."""
    return tasks_per_worker * num_workers * (CONCURRENT_PREFETCH_FACTOR if concurrency > 1 else 1)


def small_batch_prefetch(prefetch: int, batch_bytes: int, batches_held: int, num_workers: int,
                         descriptors: Optional[int], room: Optional[int]) -> Optional[int]:
    """The default ``prefetch`` widened for batches of ``batch_bytes``, or None when they are
    too large to widen for: :data:`SMALL_BATCH_PREFETCH_FACTOR` times as far ahead, within
    :data:`SMALL_AHEAD_BYTES`, the share of ``descriptors`` (the process's limit, None: none)
    and of ``room`` (bytes of memory and address space left, None: no limit), never below
    ``prefetch``."""
    if batch_bytes > SMALL_BATCH_BYTES:
        return None
    nbytes = max(batch_bytes, 1)
    widened = min(prefetch * SMALL_BATCH_PREFETCH_FACTOR, SMALL_AHEAD_BYTES // nbytes)
    if descriptors is not None:
        per_slot = 1 + num_workers
        widened = min(widened, descriptors // (SMALL_AHEAD_FD_SHARE * per_slot) - batches_held)
    if room is not None:
        widened = min(widened, prefetch + room // (SMALL_AHEAD_ROOM_SHARE * nbytes))
    return max(prefetch, widened)


# A producer whose whole prefetch is made and waiting (the consumer is the slower side) rests
# until the consumer took all but 1/RESUME_SHARE of it, then dispatches the rest in one go: one
# wake-up of the I/O thread and of each worker per top-up instead of one per batch, and workers
# that answer several tasks per wake-up. The ready batches left cover the top-up's first batch.
# Measured with a 3 ms step per batch (1 KiB samples, 2 workers): the I/O thread's CPU per batch
# 95-120 us instead of 235-256, 5-8% more steps/s; the DALI drop-in (consumer-bound) ~15% more
# samples/s; 4 instead of 2 changed neither. Below REST_MIN_PREFETCH there is nothing to save.
RESUME_SHARE = 2
REST_MIN_PREFETCH = 4


def resume_mark(prefetch: int) -> Optional[int]:
    """The ready batches at or below which a resting producer tops up its ``prefetch`` (None:
    too small a prefetch to rest)."""
    return prefetch // RESUME_SHARE if prefetch >= REST_MIN_PREFETCH else None


# A batch of a sample-mode source is cut into enough tasks that, over the prefetch, every
# worker has one running and one queued, so that it never waits for the pool between two. Each
# task costs an answer, and the pool's I/O thread a wake-up that preempts a worker; for batches
# a worker makes in under WHOLE_BATCH_S, that costs more than the wait, and a batch is cut for
# one task per worker instead. Only a prefetch under twice the workers cuts batches at all.
# Measured with prefetch=2, 2 workers, batch 256 of 1 KiB samples, interleaved, samples/s of
# one task per worker against two: +12 to +17% for batches of 0.5 ms, -1 to +8% at 0.9 ms,
# -11 to +1% at 1.7 ms, -7% at 2.9 ms.
WHOLE_BATCH_S = 0.001


def task_ranges(batch_size: int, num_workers: int, prefetch: int, batch_seconds: float = 0.0) -> int:
    """How many tasks a batch of a sample-mode source is cut into: enough that every worker has
    a task while ``prefetch`` batches are in flight and, unless a whole batch takes under
    :data:`WHOLE_BATCH_S` (``batch_seconds``, as timed; 0.0: not yet), one queued as well; no
    more (each task costs two messages)."""
    per_worker = 1 if 0.0 < batch_seconds < WHOLE_BATCH_S else 2
    return min(batch_size, max(1, math.ceil(per_worker * num_workers / prefetch)))


# -- which copy: how samples reach shared memory -----------------------------------------------

# Samples of a task wait in the worker until this many bytes of them do, then are written to
# shared memory: large ones each as soon as it is made (the callback's next array then reuses
# the memory of the last instead of faulting in new pages: a large sample held across the
# next call cost ~40%); small ones in one copy per task while the source's layout is not
# known, else each into its row as soon as it is made (gathering first cost ~6% on 1 KiB).
STREAM_BYTES = 1 << 20
# A task whose samples, sized like its first one, stay this many times under STREAM_BYTES is
# gathered without counting bytes per sample (that count cost ~10% on 1 KiB samples). A later
# sample far larger than the first is then written with the task's others.
SMALL_TASK_FACTOR = 2
# Samples of at least this many bytes are copied into a slot with streaming stores, which skip
# reading the destination into the caches only to overwrite it (a cold 4 MiB copy: 110 us
# instead of 171; the 4 MiB row about 1.35x as fast). Below it the destination may still be
# in a cache when the consumer reads it (a core's L2 is 1 MiB or more), and the read of the
# destination costs little.
STREAM_MIN_BYTES = 1 << 20
# The first size of a worker's overflow segment in a slot: one growth covers most first batches.
MIN_OVERFLOW = 1 << 20
# How a worker's overflow segment in a slot grows when a sample needs more (times what it had):
# ragged 1-4 MiB samples, batch 8, made 20% slower with 1.25 (more, longer fallocate calls).
OVERFLOW_GROWTH = 2.0
# What a worker keeps of its overflow segment in a slot it wrote (times what the batch used
# there), so that the slot's next batch maps no new pages when its share grows: with 1.25 the
# same ragged workload ran about 5% slower and held about 10% less shared memory.
OVERFLOW_KEEP = 2.0
# What a worker keeps of its overflow segment in a slot whose batch it did not write (tasks go
# to whichever worker is free, so each worker writes a slot in turn). Keeping it held a batch's
# overflow per worker in every slot: the same ragged workload (2 workers, 4 batches held) had
# 620-650 MiB of shared memory at its peak, 395 with it given back, at a cost of about 15% of its
# rate (from 518 to 430 samples/s; a worker writing a slot again faults its pages in again), on a
# callback that only fills arrays; a callback that decodes or reads spends far more per byte.
IDLE_OVERFLOW = MIN_OVERFLOW
# A worker's allocator serves requests up to this size from its heap, not from mmap: glibc's
# own upper bound for its dynamic threshold (HEAP_MAX_SIZE / 2 on 64-bit), reached from the
# first sample on instead of after many samples' page faults.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the top of a worker's heap kept rather than given back: room for twice 64
# samples of 1 MiB in flight together (concurrency=64) to be freed and made again without
# page faults.
TRIM_THRESHOLD_BYTES = 128 << 20


# -- how much is remembered: the account of skipped and replaced samples -----------------------

# Faults a source lists (the newest; every one is counted in stats() and against max_errors).
# A listed fault takes about 0.33 KiB of the consumer's memory (measured: 23.6, 24.6, 25.7 MiB
# with 3,200, 6,400, 9,600 listed); 1,000 are at most 0.33 MiB, and a job that fails 1% of its
# records at 700 samples/s lists that many within 3 minutes, after which its memory is flat
# (with 10,000 the soak's consumer rose 2.6 MiB over 24 minutes before the list was full).
FAULTS_LISTED = 1_000
# Batches whose faults a source remembers having counted, the newest: a batch taken again
# (its take interrupted and retried) counts once. Only batches in flight are taken again,
# far fewer than this; each remembered one takes about 0.1 KiB.
FAULTS_COUNTED_WINDOW = 1_024
