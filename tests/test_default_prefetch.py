"""The default prefetch: two batches per worker, more for small batches (they cost little
memory, and a consumer that waits for a CPU would otherwise find the workers idle) and for
samples in flight together (a batch waits for its slowest request)."""

import os
import time

import numpy as np

from extsrc import ParallelSource
from extsrc.engine.policy import SMALL_BATCH_BYTES  # the policy's line between small and large

BATCH = 4
WORKERS = 2
DEFAULT = 2 * WORKERS  # two per worker
HELD = 2  # batches_held's default
DEADLINE_S = 120  # generous: only a broken feature waits this long


class Marks:
    """A sample of ``nbytes``; each call leaves a file named by its index, so the test sees
    how many samples the workers made, whatever the start method."""

    def __init__(self, directory: str, nbytes: int):
        self.directory = directory
        self.nbytes = nbytes

    def __call__(self, info):
        open(os.path.join(self.directory, str(info.idx_in_epoch)), "w").close()
        return np.full(self.nbytes, info.idx_in_epoch & 0xFF, np.uint8)


def made(directory) -> int:
    return len(os.listdir(directory))


def wait_until_made(directory, samples: int) -> int:
    deadline = time.monotonic() + DEADLINE_S
    while made(directory) < samples and time.monotonic() < deadline:
        time.sleep(0.01)
    return made(directory)


def test_small_batches_go_further_ahead_with_the_default_prefetch(tmp_path):
    # Without the widening, a consumer holding one batch lets at most HELD - 1 + DEFAULT + 1
    # more be made (prefetch + batches_held slots); with it, more.
    with ParallelSource(Marks(str(tmp_path), 1024), BATCH, num_workers=WORKERS) as src:
        batches = iter(src)
        # The prefetch widens once the pool has timed the source's tasks as short (a task
        # preempted on a busy machine may take long): take batches until it has, so that
        # tasks keep running and being timed.
        taken = 0
        deadline = time.monotonic() + DEADLINE_S
        while src.prefetch <= DEFAULT and time.monotonic() < deadline:
            next(batches)
            taken += 1
        assert src.prefetch > DEFAULT
        kept = next(batches)
        beyond_default = (taken + 1 + DEFAULT + HELD) * BATCH
        assert wait_until_made(tmp_path, beyond_default + BATCH) > beyond_default
        assert int(kept[0][0]) == (taken * BATCH) & 0xFF
        # Every batch still comes once, in order.
        rest = [int(b[0][0]) for b, _ in zip(batches, range(20))]
        assert rest == [(k * BATCH) & 0xFF for k in range(taken + 1, taken + 21)]


def test_a_given_prefetch_and_large_batches_are_left_as_they_are(tmp_path):
    given = tmp_path / "given"
    large = tmp_path / "large"
    given.mkdir()
    large.mkdir()
    with ParallelSource(Marks(str(given), 1024), BATCH, num_workers=WORKERS, prefetch=DEFAULT) as src:
        next(iter(src))
        assert src.prefetch == DEFAULT
        assert src.stats().prefetch == DEFAULT
    nbytes = SMALL_BATCH_BYTES // BATCH + 1  # a batch just over the limit
    with ParallelSource(Marks(str(large), nbytes), BATCH, num_workers=WORKERS) as src:
        next(iter(src))
        assert src.prefetch == DEFAULT


def test_batches_too_large_to_widen_for_read_the_memory_limits_once(tmp_path, monkeypatch):
    # Whether to widen reads /proc and the cgroup files; deciding it anew at each dispatch cost
    # the I/O thread, in the training process, 600-700 us per batch of 1.5 MiB.
    from extsrc.shm import limits

    reads = []
    room_left = limits.room_left
    monkeypatch.setattr(limits, "room_left", lambda: reads.append(1) or room_left())
    nbytes = SMALL_BATCH_BYTES // BATCH + 1  # a batch just over the limit
    with ParallelSource(Marks(str(tmp_path), nbytes), BATCH, num_workers=WORKERS) as src:
        batches = iter(src)
        for _ in range(40):
            next(batches)
        assert src.prefetch == DEFAULT
    assert len(reads) == 1


def test_samples_in_flight_together_get_more_batches_ahead(tmp_path):
    nbytes = SMALL_BATCH_BYTES // BATCH + 1  # large enough not to widen once more
    with ParallelSource(Marks(str(tmp_path), nbytes), BATCH, num_workers=WORKERS, concurrency=4) as src:
        assert src.prefetch > DEFAULT
        batches = iter(src)
        kept = next(batches)
        # Made ahead: more than the prefetch + batches_held slots of the plain default allow.
        beyond_default = (1 + DEFAULT + HELD) * BATCH
        assert wait_until_made(tmp_path, beyond_default + BATCH) > beyond_default
        assert int(kept[0][0]) == 0
        assert [int(b[0][0]) for b, _ in zip(batches, range(12))] == [
            (k * BATCH) & 0xFF for k in range(1, 13)]
    with ParallelSource(Marks(str(tmp_path), nbytes), BATCH, num_workers=WORKERS, concurrency=4,
                        prefetch=3) as src:
        assert src.prefetch == 3


class Logged:
    """A sample of ``nbytes``; the first sample of each batch appends ``start <iteration>`` to a
    log the consumer appends its takes to as well (O_APPEND: the lines interleave whole)."""

    def __init__(self, log: str, nbytes: int):
        self.log = log
        self.nbytes = nbytes

    def __call__(self, info):
        if info.idx_in_batch == 0:
            note(self.log, f"start {info.iteration}")
        return np.full(self.nbytes, info.idx_in_epoch & 0xFF, np.uint8)


def note(log: str, line: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def test_a_consumer_slower_than_the_workers_gets_its_prefetch_topped_up_in_one_go(tmp_path):
    # Once the whole prefetch is made and waiting, nothing more is made until the consumer took
    # half of it; then the rest at once. Each take used to start the next batch at once: a
    # wake-up of the I/O thread and of a worker per batch, in the training process too.
    log = str(tmp_path / "log")
    prefetch, takes, first_fill = 8, 60, 12
    with ParallelSource(Logged(log, 64), BATCH, num_workers=WORKERS, prefetch=prefetch) as src:
        batches = iter(src)
        for k in range(takes):
            next(batches)
            note(log, f"take {k}")
            time.sleep(0.01)  # a consumer slower than the workers (a training step)
    with open(log) as f:
        lines = f.read().split()[::2]  # "start" or "take"
    gaps = []  # batches started between one take and the next, once the first fill is over
    for word in lines[lines.index("take") + 1:]:
        if word == "take":
            gaps.append(0)
        elif gaps:
            gaps[-1] += 1
    gaps = gaps[first_fill:-1]
    # Work is only ever later on a busy machine, never earlier: quiet gaps only grow there.
    quiet = sum(1 for g in gaps if g == 0)
    assert quiet >= len(gaps) // 3, gaps
    assert max(gaps) >= prefetch // 2, gaps  # the top-up comes whole
