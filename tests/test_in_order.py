"""in_order=False: a finished batch is handed out before an earlier one that is not."""

import json
import time

import numpy as np
import pytest

from extsrc import EpochLengthError, Hooks, Order, ParallelSource, SampleError, StateMismatchError
from extsrc.engine.assembly import PendingBatch

from sources import HeldBack, sample_of

BATCH = 4
TIMEOUT_S = 120  # a hang fails the test instead of stalling the suite


def iteration_of(batch):
    return int(batch.as_array()[0, 0]) // BATCH


def check_contents(batch):
    """Each batch holds the samples of its own iteration, whenever it comes."""
    rows = batch.as_array()
    first = int(rows[0, 0])
    assert first % BATCH == 0
    np.testing.assert_array_equal(rows[:, 0], np.arange(first, first + BATCH))
    np.testing.assert_array_equal(rows[:, 2], first // BATCH)  # info.iteration


ROUND_ROBIN = Hooks(assign=lambda iteration, workers: iteration % workers)  # DataLoader's order


def held_source(tmp_path, held, records=32, **kwargs):
    callback = HeldBack(str(tmp_path / "release"), held, BATCH)
    kwargs.setdefault("order", Order(records))
    kwargs.setdefault("num_workers", 2)
    return ParallelSource(callback, BATCH, hooks=ROUND_ROBIN, in_order=False, timeout=TIMEOUT_S,
                          **kwargs)


def test_later_batches_come_while_the_first_is_held_back_and_each_comes_once(tmp_path):
    with held_source(tmp_path, held={0}) as src:
        got = []
        for batch in src:
            check_contents(batch)
            got.append(iteration_of(batch))
            if len(got) == 3:
                (tmp_path / "release").touch()
        assert 0 not in got[:3]  # batch 0 was still held back when three had come
        assert sorted(got) == list(range(8))
        # The next epoch has the same batches.
        assert sorted(iteration_of(b) for b in src) == list(range(8))


def test_in_order_true_is_the_default_and_keeps_the_order():
    with ParallelSource(sample_of, BATCH, num_workers=2, order=Order(32)) as src:
        assert src.spec.in_order is True
        assert [int(b.as_array()[0, 0]) // BATCH for b in src] == list(range(8))


def test_a_free_worker_gets_the_next_batches_while_the_other_is_stuck(tmp_path):
    # Each batch is one task (prefetch 4, 2 workers); batch 0 is stuck, and so is the task its
    # worker took beside it. The consumer, slower than the free worker, takes every batch the
    # free worker made: then no answer is coming, and only the take can have the next batches
    # dispatched (before, nothing woke the pool's thread: the loop waited for batch 0).
    callback = HeldBack(str(tmp_path / "release"), {0}, BATCH)
    with ParallelSource(callback, BATCH, num_workers=2, prefetch=4, order=Order(32), in_order=False,
                        timeout=TIMEOUT_S) as src:
        epoch = iter(src)
        early = []
        for _ in range(5):
            time.sleep(0.05)  # not a timing assertion: it lets the free worker run ahead
            early.append(iteration_of(epoch.__next__()))
        (tmp_path / "release").touch()
        rest = [iteration_of(batch) for batch in epoch]
    assert 0 not in early and sorted(early + rest) == list(range(8))


def test_a_state_saved_after_batches_came_early_resumes_with_exactly_the_rest(tmp_path):
    with held_source(tmp_path, held={0}) as src:
        epoch = iter(src)
        early = [iteration_of(epoch.__next__()) for _ in range(3)]
        state = json.loads(json.dumps(src.get_state()))
    assert state["iteration"] == 0
    assert state["handed_out"] == sorted(early)
    with ParallelSource(sample_of, BATCH, num_workers=2, order=Order(32)) as resumed:
        resumed.set_state(state)
        rest = [int(b.as_array()[0, 0]) // BATCH for b in resumed]
        assert sorted(rest + early) == list(range(8))  # nothing repeated, nothing lost
        assert rest == sorted(rest)  # in order, as the resumed source asks
        assert [int(b.as_array()[0, 0]) // BATCH for b in resumed] == list(range(8))


def test_a_state_with_batches_handed_out_refuses_another_batch_size():
    state = {"epoch_idx": 0, "iteration": 0, "batch_size": 4, "handed_out": [1, 3]}
    with ParallelSource(sample_of, 8, num_workers=1) as src:
        with pytest.raises(StateMismatchError, match="handed out ahead"):
            src.set_state(state)
    with ParallelSource(sample_of, 4, num_workers=1) as src:
        with pytest.raises(ValueError, match="handed_out must be a list of iterations after"):
            src.set_state({"epoch_idx": 0, "iteration": 2, "handed_out": [1]})


def test_the_short_last_batch_and_the_end_come_in_their_place(tmp_path):
    # 30 records: batch 7 is short (2 samples). Batch 0 is held back (worker 0 makes 0, 3, 6)
    # until the four whole batches of the other workers came; batch 7 of worker 1 is made
    # meanwhile, and still comes last.
    with held_source(tmp_path, held={0}, records=30, last_batch="partial", num_workers=3) as src:
        got = []
        epoch = iter(src)
        for _ in range(4):
            got.append(iteration_of(epoch.__next__()))
        assert sorted(got) == [1, 2, 4, 5]
        (tmp_path / "release").touch()
        sizes = {}
        for batch in epoch:
            got.append(iteration_of(batch))
            sizes[got[-1]] = len(batch)
    assert got[-1] == 7 and sizes[7] == 2
    assert sorted(got) == list(range(8))


def test_an_epoch_that_ends_before_a_batch_handed_out_early_is_an_error(tmp_path):
    # No order: the callback ends the epoch at batch 1, but batch 2 was whole and came first.
    callback = HeldBack(str(tmp_path / "release"), {0, 1}, BATCH, ends={1})
    with ParallelSource(callback, BATCH, num_workers=3, hooks=ROUND_ROBIN, in_order=False,
                        prefetch=3, timeout=TIMEOUT_S) as src:
        epoch = iter(src)
        assert iteration_of(epoch.__next__()) == 2
        (tmp_path / "release").touch()
        got = []
        with pytest.raises(EpochLengthError, match=r"ended epoch 0 at batch 1, and batch\(es\) \[2"):
            while True:
                got.append(iteration_of(epoch.__next__()))
        assert 0 in got and 1 not in got


def test_a_batch_that_cannot_be_made_here_raises_in_its_place_even_when_finished_early(
        tmp_path, monkeypatch):
    # Batch 2 (worker 2's) fails as it is made in this process (as when its dense copy does not
    # fit the memory limits); batch 0 (worker 0's) is held back until batch 4 came.
    build = PendingBatch.build

    def failing_build(self, *args, **kwargs):
        if self.iteration == 2:
            raise SampleError("batch 2 cannot be made")
        return build(self, *args, **kwargs)

    monkeypatch.setattr(PendingBatch, "build", failing_build)
    callback = HeldBack(str(tmp_path / "release"), {0}, BATCH)
    events = []
    with ParallelSource(callback, BATCH, num_workers=3, hooks=ROUND_ROBIN, in_order=False,
                        order=Order(32), timeout=TIMEOUT_S) as src:
        epoch = iter(src)
        while True:
            try:
                events.append(iteration_of(epoch.__next__()))
            except StopIteration:
                break
            except SampleError as error:
                events.append(str(error))
            if 4 in events or "batch 2 cannot be made" in events:
                (tmp_path / "release").touch()
    assert events.count("batch 2 cannot be made") == 1 and 2 not in events, events
    assert {0, 1} <= set(events[:events.index("batch 2 cannot be made")]), events
