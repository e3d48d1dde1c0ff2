"""The worker's sample loop keeps nothing longer than it must (its speed depends on it)."""

import weakref

import numpy as np

from extsrc import ParallelSource

LARGE = 2 << 20  # bytes: past the worker's streaming threshold, so written one by one

_previous = []  # per worker process (fork): a weak reference to the sample returned last


def notes_if_previous_alive(info):
    """A large sample whose first byte says whether the one returned before is still alive."""
    alive = bool(_previous) and _previous[0]() is not None
    sample = np.zeros(LARGE, np.uint8)
    sample[0] = alive
    _previous[:] = [weakref.ref(sample)]
    return sample


def test_a_large_sample_is_let_go_before_the_callback_makes_the_next():
    # A sample the worker still holds while the callback makes the next one keeps its memory
    # from being reused: each new array faults in fresh pages.
    with ParallelSource(notes_if_previous_alive, 4, num_workers=1, start_method="fork") as src:
        it = iter(src)
        next(it)  # the first batch tells the layout (its first sample is kept to compare)
        firsts = [int(sample[0]) for _ in range(3) for sample in next(it)]
    assert firsts == [0] * len(firsts)


_made = None  # a multiprocessing.Value shared with fork workers: samples made


def counts_samples(info):
    with _made.get_lock():
        _made.value += 1
    return np.full(4, info.idx_in_epoch, np.int64)


def test_finished_batches_not_taken_yet_leave_the_workers_work_within_the_kept_memory():
    # prefetch=2, batches_held=2: the source keeps 4 batches of memory. While the consumer
    # holds none, finished batches waiting for it do not stop the workers: up to 4 batches
    # are made ahead (never more), not only 2.
    import multiprocessing
    import time

    global _made
    _made = multiprocessing.get_context("fork").Value("q", 0)
    batch = 4
    with ParallelSource(counts_samples, batch, num_workers=1, start_method="fork", prefetch=2,
                        batches_held=2) as src:
        it = iter(src)
        assert next(it)[0][0] == 0  # taken and dropped: the consumer holds nothing
        deadline = time.monotonic() + 30
        while _made.value < 5 * batch and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # whatever else would be made by now
        made = _made.value
        assert made == 5 * batch, f"{made // batch} batches made, expected 1 taken + 4 ahead"
        assert [int(next(it)[0][0]) for _ in range(4)] == [4, 8, 12, 16]


SMALL = 1 << 10  # bytes: a task of such samples stays far under the streaming threshold
_earlier = []  # per worker process (fork): weak references to the samples it returned


def notes_earlier_alive(info):
    """A small sample whose first 8 bytes count the samples returned before it that are still
    alive, and whose next 8 hold its index."""
    alive = sum(ref() is not None for ref in _earlier)
    sample = np.zeros(SMALL, np.uint8)
    sample[:16].view(np.int64)[:] = (alive, info.idx_in_epoch)
    _earlier[:] = _earlier[-63:] + [weakref.ref(sample)]
    return sample


def test_small_samples_are_let_go_as_they_come_once_the_layout_is_known():
    # A worker that gathered a task's small samples before writing them held all of them
    # (64 here) until the task's end: malloc then served each new array from its slow path.
    batch = 64
    with ParallelSource(notes_earlier_alive, batch, num_workers=1, start_method="fork") as src:
        it = iter(src)
        next(it)  # the first batch tells the layout: its samples are gathered, as before
        rows = [sample[:16].view(np.int64) for _ in range(3) for sample in next(it)]
        alive = [int(r[0]) for r in rows]
        indices = [int(r[1]) for r in rows]
    assert indices == list(range(batch, 4 * batch))
    assert max(alive) <= 1, f"samples still alive at each call: {alive}"


def ragged_at_100(info):
    """1 KiB samples, but sample 100 has 3 bytes more; each filled with its index."""
    return np.full(SMALL + 3 * (info.idx_in_epoch == 100), info.idx_in_epoch % 251, np.uint8)


def test_a_sample_unlike_the_layout_among_samples_written_in_place_keeps_its_place():
    with ParallelSource(ragged_at_100, 64, num_workers=1, start_method="fork") as src:
        it = iter(src)
        batches = [next(it) for _ in range(3)]
    for b, batch in enumerate(batches):
        for k, sample in enumerate(batch):
            index = b * 64 + k
            assert sample.shape == (SMALL + 3 * (index == 100),), index
            assert (sample == index % 251).all(), index
    assert not batches[1].is_dense and batches[2].is_dense
