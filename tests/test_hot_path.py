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
