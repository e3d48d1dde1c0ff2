"""Ragged samples come back as the callback made them, whatever their memory layout and dtype.

A ragged sample is copied into the worker's overflow area: its bytes as they are when the
array is C-contiguous, element by element otherwise (transposed, strided, Fortran-ordered).
Either way the consumer must see the same values, shape and dtype, empty samples included; of a
masked array, its data (as a dense batch gives it).
"""

import numpy as np
import pytest

import extsrc

BATCH = 6
BATCHES = 4


def _made(idx: int) -> tuple:
    """Sample ``idx``: one output per layout, each of a size that changes with ``idx``."""
    n = 1 + idx % 4
    grid = np.arange(3 * n, dtype=np.int32).reshape(3, n) + idx
    return (
        grid.T,                                                   # transposed: not C-contiguous
        (np.arange(2 * n, dtype=np.float64) * idx)[::2],          # strided
        np.asfortranarray(grid.astype(np.int16).T.copy()),        # Fortran order
        np.full((idx % 3, 2), idx, dtype=np.uint8),               # empty for every third sample
        (np.arange(n) + idx).astype(">i4"),                       # big-endian
        np.arange(n) % 2 == idx % 2,                              # bool
        (np.arange(n) + 1j * idx).astype(np.complex64),           # complex
        np.linspace(0, idx, n).astype(np.float16),                # half floats
        np.ma.masked_array(np.arange(n) + idx, mask=np.arange(n) % 2 == 0),  # masked: its data
        np.ma.masked_array(np.arange(2 * n) * idx, mask=False)[::2],        # masked and strided
    )


def ragged(info: extsrc.SampleInfo) -> tuple:
    return _made(info.idx_in_epoch)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_ragged_samples_of_every_layout_come_back_as_made(start_method):
    outputs = len(_made(0))
    with extsrc.ParallelSource(ragged, BATCH, num_workers=2, num_outputs=outputs,
                               start_method=start_method) as source:
        batches = iter(source)
        for iteration in range(BATCHES):
            batch = next(batches)
            for k in range(BATCH):
                expected = _made(iteration * BATCH + k)
                for j in range(outputs):
                    got = batch[j][k]
                    assert type(got) is np.ndarray
                    where = f"batch {iteration}, sample {k}, output {j}"
                    assert got.dtype == expected[j].dtype, where
                    assert got.shape == expected[j].shape, where
                    assert np.array_equal(got, np.ma.getdata(expected[j])), where
