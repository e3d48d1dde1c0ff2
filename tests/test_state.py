"""Checkpointing: get_state() names the next batch; set_state() resumes exactly there."""

import json

import numpy as np
import pytest

from extsrc import EpochSupersededError, Order, ParallelSource, StateMismatchError

from sources import StopsAt, sample_of


def position(state):
    return state["epoch_idx"], state["iteration"]


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
    assert position(state) == (1, 3)
    with ParallelSource(sample_of, 4, num_workers=2) as resumed:
        resumed.set_state(state)
        np.testing.assert_array_equal(take(iter(resumed), 3), expected)
        assert position(resumed.get_state()) == (1, 6)


def test_state_after_an_epoch_ends_points_at_the_next_epoch():
    with ParallelSource(StopsAt(8), 4) as src:
        assert len(list(src)) == 2
        assert position(src.get_state()) == (1, 0)


@pytest.mark.parametrize("records", [40, 41])  # a full last batch, a short one
def test_state_after_an_orders_last_batch_points_at_the_next_epoch_before_the_loop_ends(records):
    # A checkpoint taken right after the epoch's last batch, before the loop saw the end: with
    # a full last batch it used to say (0, 5), and a loop resumed from it gave no batch.
    def record_and_epoch(info):
        return np.array([info.record, info.epoch_idx], np.int64)

    with ParallelSource(record_and_epoch, 8, num_workers=2, order=Order(records),
                        last_batch="partial") as src:
        it = iter(src)
        take(it, len(src))
        state = src.get_state()
        assert position(state) == (1, 0)
        src.set_state(state)
        epochs = {int(e) for batch in src for e in batch.as_array()[:, 1]}
    assert epochs == {1}


def test_iterables_cannot_resume_mid_epoch():
    with ParallelSource([[np.zeros(1)]] * 3, 1, batch=True) as src:
        with pytest.raises(ValueError, match="callable source"):
            src.set_state({"epoch_idx": 0, "iteration": 2})


def firsts(batches):
    return [int(b[0]) for b in batches]


def test_a_state_resumes_at_the_same_record_with_a_batch_size_that_divides_the_position():
    with ParallelSource(sample_of, 8, num_workers=2) as src:
        it = iter(src)
        take(it, 3)  # 24 records
        state = src.get_state()
    assert state["records"] == 24
    with ParallelSource(sample_of, 12, num_workers=2) as resumed:
        resumed.set_state(state)
        batch = next(iter(resumed)).as_array()
        assert int(batch[0][0]) == 24  # record 24, not 36: nothing skipped
        assert position(resumed.get_state()) == (0, 3)


def test_a_state_that_falls_inside_a_batch_of_the_new_size_is_refused_saying_why():
    with ParallelSource(sample_of, 8, num_workers=2) as src:
        it = iter(src)
        take(it, 3)  # 24 records
        state = src.get_state()
    with ParallelSource(sample_of, 16, num_workers=2) as resumed:
        with pytest.raises(StateMismatchError, match=r"after 24 records .* batch_size=16.* 8 records"):
            resumed.set_state(state)


def test_a_state_saved_with_another_order_or_shard_or_none_is_refused():
    with ParallelSource(sample_of, 4, order=Order(64, shuffle=True, seed=1)) as src:
        state = src.get_state()
    for other in (Order(64, shuffle=True, seed=2), Order(64, shuffle=True, seed=1, shard=(1, 2))):
        with ParallelSource(sample_of, 4, order=other) as resumed:
            with pytest.raises(StateMismatchError, match="differing in"):
                resumed.set_state(state)
    with ParallelSource(sample_of, 4) as unordered:
        with pytest.raises(StateMismatchError, match="with the order"):
            unordered.set_state(state)
    with ParallelSource(sample_of, 4) as src:
        plain = src.get_state()
    with ParallelSource(sample_of, 4, order=Order(64)) as ordered:
        with pytest.raises(StateMismatchError, match="without an order"):
            ordered.set_state(plain)


def test_a_second_loop_over_one_source_makes_the_first_raise_instead_of_ending_short():
    with ParallelSource(sample_of, 4, num_workers=2) as src:
        first = iter(src)
        next(first)
        second = iter(src)
        next(second)
        with pytest.raises(EpochSupersededError, match="newer iter"):
            next(first)
        assert int(next(second).as_array()[0][0]) == 4  # the newer loop goes on


def test_set_state_during_a_loop_makes_that_loop_raise():
    with ParallelSource(sample_of, 4, num_workers=2) as src:
        it = iter(src)
        next(it)
        src.set_state({"epoch_idx": 0, "iteration": 0})
        with pytest.raises(EpochSupersededError, match="set_state"):
            next(it)


def test_close_still_ends_a_loop_quietly():
    src = ParallelSource(sample_of, 4, num_workers=1)
    it = iter(src)
    next(it)
    src.close()
    assert list(it) == []
