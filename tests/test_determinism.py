"""The same callback gives the same batches whatever the workers, start method or timing."""

import numpy as np
import pytest

from extsrc import ParallelSource

from sources import jittered


def collect(**kwargs):
    with ParallelSource(jittered, 6, **kwargs) as src:
        out = []
        for _ in range(2):
            it = iter(src)
            out.append([next(it).as_array().copy() for _ in range(5)])
    return np.array(out)


def test_same_batches_for_any_worker_count_despite_jitter():
    reference = collect(num_workers=1)
    for workers in (2, 3):
        np.testing.assert_array_equal(collect(num_workers=workers, prefetch=3), reference)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_same_batches_for_every_start_method(method):
    np.testing.assert_array_equal(
        collect(num_workers=2, start_method=method), collect(num_workers=2, start_method="fork")
    )
