"""backend="ray" under attack: cases where Ray actors give other batches than worker processes,
or fail otherwise than they do. Each test fails on the code it was written against.
"""

from __future__ import annotations

import numpy as np
import pytest

from extsrc import ParallelSource

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("local_ray")]


def _firsts(batches=3, **kwargs):
    """The first value of every sample of the first ``batches`` batches."""
    out = []
    with ParallelSource(**kwargs) as src:
        it = iter(src)
        for _ in range(batches):
            out.append([int(sample[0]) for sample in next(it)])
    return out


class RefillsOneBuffer:
    """Returns the same large array for every sample, refilled with the sample's index: a loader
    that decodes each sample into one reusable buffer. Worker processes write each sample of a
    MiB or more into shared memory as soon as it is made (streaming), so this is safe there."""

    def __init__(self, sample_bytes: int):
        self.sample_bytes = sample_bytes
        self.buffer = None

    def __getstate__(self):
        return {"sample_bytes": self.sample_bytes, "buffer": None}

    def __call__(self, info):
        if self.buffer is None:
            self.buffer = np.zeros(self.sample_bytes, np.uint8)
        self.buffer[:] = info.idx_in_epoch % 251
        return self.buffer


def test_a_callback_that_refills_one_large_buffer_per_sample_gives_what_processes_give():
    # README: "An answer never holds the callback's memory: a callback that reuses its buffers
    # gives the same batches as with worker processes." The actor keeps the streamed chunks
    # (lists of the callback's arrays) until the task ends and copies them only then, so every
    # sample of a task comes back as the task's last one.
    kwargs = dict(source=RefillsOneBuffer(1 << 20), batch_size=4, num_workers=2)
    theirs = _firsts(**kwargs)
    assert theirs == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    ours = _firsts(backend="ray", **kwargs)
    assert ours == theirs
