"""A sample's dtype comes back as the callback made it, byte order included, in every batch.

The first batches of a source are written apart (the workers do not know the output's layout
yet) and joined into one array in the consumer; later batches are written in place. A non-native
dtype such as big-endian ``>f8`` must come back as ``>f8`` from both, and from the joins that
``on_error="skip"`` and ``Batch.as_array()`` make, not turned into the native ``<f8``.
"""

import numpy as np
import pytest

from extsrc import Batch, Hooks, ParallelSource

BATCH = 4
BATCHES = 5
DTYPES = (">f8", ">i2")
SKIPPED = 2 * BATCH + 1


def _made(idx: int) -> tuple:
    return tuple((np.arange(3) + idx).astype(d) for d in DTYPES)


def by_sample(info):
    return _made(info.idx_in_epoch)


def by_batch(iteration):
    """One array per output: the batch's samples stacked, in their own dtype."""
    samples = [_made(iteration * BATCH + k) for k in range(BATCH)]
    return tuple(np.stack([s[j] for s in samples], dtype=d) for j, d in enumerate(DTYPES))


def skipping(info):
    if info.idx_in_epoch == 2:
        raise ValueError("a bad record")
    return _made(info.idx_in_epoch)


def _check(batches, expected_idx):
    for iteration, batch in enumerate(batches):
        for j, dtype in enumerate(DTYPES):
            column = batch[j]
            array = column if isinstance(column, np.ndarray) else column.as_array()
            where = f"batch {iteration}, output {j}"
            assert array.dtype.str == dtype, where
            for k, sample in enumerate(column):
                assert sample.dtype.str == dtype, where
                idx = expected_idx(iteration, k)
                assert np.array_equal(sample, _made(idx)[j]), f"{where}, sample {k}"


@pytest.mark.parametrize("dense_arrays", [False, True])
def test_a_big_endian_output_stays_big_endian_in_every_batch(dense_arrays):
    with ParallelSource(by_sample, BATCH, num_workers=2, num_outputs=len(DTYPES),
                        hooks=Hooks(dense_arrays=dense_arrays)) as source:
        batches = iter(source)
        got = [next(batches) for _ in range(BATCHES)]
        _check(got, lambda iteration, k: iteration * BATCH + k)


def test_a_big_endian_batch_stays_big_endian():
    with ParallelSource(by_batch, BATCH, batch=True, num_workers=2,
                        num_outputs=len(DTYPES)) as source:
        batches = iter(source)
        got = [next(batches) for _ in range(BATCHES)]
        _check(got, lambda iteration, k: iteration * BATCH + k)


@pytest.mark.parametrize("dense_arrays", [False, True])
def test_batches_refilled_after_a_skip_stay_big_endian(dense_arrays):
    with ParallelSource(skipping, BATCH, num_workers=2, num_outputs=len(DTYPES), on_error="skip",
                        hooks=Hooks(dense_arrays=dense_arrays)) as source:
        batches = iter(source)
        got = [next(batches) for _ in range(BATCHES)]
        _check(got, lambda iteration, k: iteration * BATCH + k + (iteration * BATCH + k >= 2))


def test_as_array_keeps_the_samples_dtype():
    samples = [(np.arange(3) + k).astype(">f8") for k in range(2)]
    assert Batch(samples).as_array().dtype.str == ">f8"
    mixed = Batch([np.arange(3, dtype=">f8"), np.arange(3, dtype="<f4")])
    assert mixed.as_array().dtype == np.float64  # mixed dtypes still stack to their common one


def scalar_sample(info):
    if info.idx_in_epoch == SKIPPED:
        raise ValueError("a bad record")
    return np.array(info.idx_in_epoch, ">i4")  # shape (): a row of a dense batch is a scalar


def test_big_endian_samples_of_shape_nothing_stay_big_endian_arrays():
    # A skip in a batch written in place (the third: the first two are written apart) sends the
    # task's later samples through the checks, against the task's first sample: that one must
    # keep its byte order for them to pass.
    with ParallelSource(scalar_sample, BATCH, num_workers=2, on_error="skip") as source:
        batches = iter(source)
        got = [next(batches) for _ in range(BATCHES)]
    expected = [k for k in range(BATCH * BATCHES + 1) if k != SKIPPED]
    for iteration, batch in enumerate(got):
        assert batch.as_array().dtype.str == ">i4"
        for k, sample in enumerate(batch):
            where = f"batch {iteration}, sample {k}"
            assert isinstance(sample, np.ndarray) and sample.dtype.str == ">i4", where
            assert sample.shape == () and int(sample) == expected[iteration * BATCH + k], where


def labels_and_masked(iteration):
    """A batch of big-endian labels (one array, samples of shape ()) and a masked array."""
    labels = (np.arange(BATCH) + iteration * BATCH).astype(">i4")
    data = np.arange(BATCH * 2, dtype=np.float64).reshape(BATCH, 2) + 100 * iteration
    return labels, np.ma.masked_array(data, mask=data % 3 == 0)


def test_a_batch_of_big_endian_labels_and_a_masked_array_come_back_as_given():
    with ParallelSource(labels_and_masked, BATCH, batch=True, num_workers=2, num_outputs=2) as source:
        batches = iter(source)
        got = [next(batches) for _ in range(BATCHES)]
    for iteration, (labels, data) in enumerate(got):
        expected_labels, expected_data = labels_and_masked(iteration)
        assert [s.dtype.str for s in labels] == [">i4"] * BATCH, f"batch {iteration}"
        assert labels.as_array().tolist() == expected_labels.tolist(), f"batch {iteration}"
        # A masked array's data, masked elements included, as a dense batch of it gives it.
        assert np.array_equal(data.as_array(), expected_data.data), f"batch {iteration}"


def scalar_or_masked(info):
    sample = np.array(info.idx_in_epoch, ">i4")
    # A subclass sample in a batch written in place takes the checks against the task's first.
    return np.ma.masked_array(sample) if info.idx_in_epoch == 3 * BATCH + 1 else sample


def test_samples_added_one_by_one_are_checked_against_a_first_of_their_byte_order():
    # concurrency=2: a worker adds each sample as it comes, the first ones into the dense rows.
    with ParallelSource(scalar_or_masked, BATCH, num_workers=1, concurrency=2) as source:
        batches = iter(source)
        got = [next(batches).as_array() for _ in range(BATCHES)]
    assert [b.dtype.str for b in got] == [">i4"] * BATCHES
    assert [b.tolist() for b in got] == [list(range(i * BATCH, (i + 1) * BATCH)) for i in range(BATCHES)]
