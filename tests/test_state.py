"""Checkpointing: get_state() names the next batch; set_state() resumes exactly there."""

import json

import numpy as np
import pytest

from extsrc import ParallelSource

from sources import StopsAt, sample_of


def take(it, n):
    return [next(it).as_array().copy() for _ in range(n)]


def test_resume_mid_epoch_gives_the_batches_an_uninterrupted_run_gives():
    with ParallelSource(sample_of, 4, num_workers=2) as src:
        it = iter(src)
        take(it, 1)
        it = iter(src)  # epoch 1
        take(it, 3)
        state = json.loads(json.dumps(src.get_state()))
        expected = take(it, 3)
    assert state == {"epoch_idx": 1, "iteration": 3}
    with ParallelSource(sample_of, 4, num_workers=2) as resumed:
        resumed.set_state(state)
        np.testing.assert_array_equal(take(iter(resumed), 3), expected)
        assert resumed.get_state() == {"epoch_idx": 1, "iteration": 6}


def test_state_after_an_epoch_ends_points_at_the_next_epoch():
    with ParallelSource(StopsAt(8), 4) as src:
        assert len(list(src)) == 2
        assert src.get_state() == {"epoch_idx": 1, "iteration": 0}


def test_iterables_cannot_resume_mid_epoch():
    with ParallelSource([[np.zeros(1)]] * 3, 1, batch=True) as src:
        with pytest.raises(ValueError, match="callable source"):
            src.set_state({"epoch_idx": 0, "iteration": 2})
