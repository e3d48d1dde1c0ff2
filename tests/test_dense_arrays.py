"""Hooks(hooks=Hooks(dense_arrays=True)): an output whose samples lie side by side comes as one array."""

import numpy as np
import pytest

from extsrc import Batch, Hooks, ParallelSource
from extsrc.shm.slots import lease_of

from sources import StopsAt, two_outputs


def test_a_dense_output_comes_as_one_array_and_a_ragged_one_as_a_batch():
    with ParallelSource(two_outputs, 5, num_outputs=2, num_workers=2, hooks=Hooks(dense_arrays=True)) as src:
        it = iter(src)
        for i in range(4):  # the first batch too, written before the layout was known
            images, ragged = next(it)
            assert type(images) is np.ndarray and images.shape == (5, 2, 3)
            assert images[:, 0, 0].tolist() == list(range(5 * i, 5 * i + 5))
            assert isinstance(ragged, Batch) and [r.tolist() for r in ragged] == [
                list(range(k + 1)) for k in range(5)]


def test_the_array_is_a_view_of_the_batchs_shared_memory_not_a_copy():
    with ParallelSource(StopsAt(40), 4, num_workers=2, hooks=Hooks(dense_arrays=True)) as src:
        # Batches dispatched before the output's layout was known are private copies (see
        # Batch); from then on, views.
        arrays = list(src)
    assert all(type(array) is np.ndarray for array in arrays)
    assert lease_of(arrays[-1]) is not None and not arrays[-1].flags.owndata


def test_arrays_kept_from_every_batch_of_two_epochs_stay_right():
    with ParallelSource(StopsAt(48), 4, num_workers=2, hooks=Hooks(dense_arrays=True)) as src:
        epochs = [list(src) for _ in range(2)]
    for epoch_idx, epoch in enumerate(epochs):
        assert [batch[:, 0].tolist() for batch in epoch] == [
            [k, k + 1, k + 2, k + 3] for k in range(0, 48, 4)]
        assert [int(batch[0, 3]) for batch in epoch] == [epoch_idx] * 12


def test_without_it_a_dense_output_is_still_a_batch():
    with ParallelSource(StopsAt(8), 4) as src:
        batch = next(iter(src))
    assert isinstance(batch, Batch) and batch.is_dense


def test_dense_arrays_must_be_a_bool():
    with pytest.raises(TypeError, match="hooks.dense_arrays must be True or False, got 'yes'"):
        ParallelSource(StopsAt(8), 4, hooks=Hooks(dense_arrays="yes"))
