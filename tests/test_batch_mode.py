"""Batch mode: callables, BatchInfo, iterables and generator functions."""

import numpy as np
import pytest

from extsrc import BatchInfo, Hooks, ParallelSource, SampleError, SourcePicklingError

from sources import batch_of_iteration


def test_callable_gets_the_iteration_number():
    with ParallelSource(batch_of_iteration, 4, batch=True, num_workers=2) as src:
        it = iter(src)
        batches = [[int(s[0]) for s in next(it)] for _ in range(3)]  # copy: arrays are recycled
    assert [b[0] for b in batches] == [0, 10, 20]
    assert batches[2] == [20, 21, 22, 23]


def test_batch_info_gives_iteration_and_epoch():
    def source(info):
        assert isinstance(info, BatchInfo)
        if info.iteration == 2:
            raise StopIteration
        return [np.array([info.iteration, info.epoch_idx])] * 2

    with ParallelSource(source, 2, batch=True, hooks=Hooks(batch_info=True)) as src:
        seen = [[tuple(b[0]) for b in src] for _ in range(2)]
    assert seen == [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]


def test_generator_function_restarts_every_epoch():
    def generator():
        for i in range(3):
            yield [np.full((2,), i, np.int16)] * 4

    with ParallelSource(generator, 4, batch=True, num_workers=2) as src:
        epochs = [[int(b[0][0]) for b in src] for _ in range(2)]
    assert epochs == [[0, 1, 2], [0, 1, 2]]


def test_iterable_runs_in_one_worker_in_order():
    data = [(np.full((1,), i), np.full((2,), -i)) for i in range(5)]
    batches = [tuple([a] * 3 for a in pair) for pair in data]

    with ParallelSource(batches, 3, batch=True, num_outputs=2, num_workers=2) as src:
        got = [(int(a[0][0]), int(b[0][1])) for a, b in src]
    assert got == [(i, -i) for i in range(5)]


class _TellsItsEpoch:
    """Two batches a pass, each of the epoch the worker was told before the pass began."""

    def told(self, epoch_idx):
        self.epoch = epoch_idx

    def __iter__(self):
        return iter([np.full((2, 1), self.epoch)] * 2)


def test_an_iterable_is_told_each_epoch_before_its_pass_begins():
    with ParallelSource(_TellsItsEpoch(), 2, batch=True, num_workers=1,
                        hooks=Hooks(begin_epoch=_TellsItsEpoch.told)) as src:
        src.set_state({"epoch_idx": 5, "iteration": 0})
        got = [[int(b[0][0]) for b in src] for _ in range(2)]
    assert got == [[5, 5], [6, 6]]


def test_a_dense_array_is_accepted_as_a_batch():
    def source(iteration):
        return np.arange(12, dtype=np.float32).reshape(4, 3) + iteration

    with ParallelSource(source, 4, batch=True) as src:
        it = iter(src)
        batches = [next(it) for _ in range(3)]
    assert batches[2].is_dense
    np.testing.assert_array_equal(batches[2].as_array(), source(2))


def test_a_batch_larger_than_batch_size_is_an_error():
    def source(iteration):
        return [np.full((2,), k) for k in range(6)]

    with ParallelSource(source, 4, batch=True) as src:
        with pytest.raises(SampleError, match="returned 6 samples, more than batch_size=4"):
            next(iter(src))


def test_shorter_batches_are_fine():
    def source(iteration):
        return [np.full((2,), k) for k in range(iteration + 1)]

    with ParallelSource(source, 4, batch=True) as src:
        it = iter(src)
        assert [len(next(it)) for _ in range(4)] == [1, 2, 3, 4]


def test_iterables_need_batch_mode():
    with pytest.raises(TypeError, match="batch=True"):
        ParallelSource([1, 2, 3], 2)


def test_a_generator_object_that_ran_out_says_so_at_the_next_epoch():
    def batches():
        for i in range(3):
            yield [np.full((2,), i, np.int32)] * 2

    with ParallelSource(batches(), 2, batch=True) as src:
        assert [int(b[0][0]) for b in src] == [0, 1, 2]
        with pytest.raises(SampleError, match="one-pass iterator .*epoch 1 is empty.*generator function itself"):
            list(src)


def test_a_generator_function_starts_over_every_epoch():
    def batches():
        for i in range(3):
            yield [np.full((2,), i, np.int32)] * 2

    with ParallelSource(batches, 2, batch=True) as src:
        assert [[int(b[0][0]) for b in src] for _ in range(2)] == [[0, 1, 2]] * 2


def test_a_generator_object_with_spawn_is_refused_with_the_fix():
    def batches():
        yield [np.zeros(2)]

    src = ParallelSource(batches(), 2, batch=True, start_method="spawn")
    with pytest.raises(SourcePicklingError, match="generator object.*source=gen, not source=gen\\(\\)"):
        src.start()
    src.close()
