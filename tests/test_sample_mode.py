"""Sample mode: what each batch holds, in which order, and how it is laid out."""

import numpy as np
import pytest

from extsrc import Batch, Hooks, ParallelSource, SampleInfo

from sources import (CalledSample, CalledSampleSubclass, ClassCall, RecordsWorkerStart,
                     ReturnsWorkerStart, StaticCall, auto_outputs, outputs_by_iteration,
                     outputs_change_at_5, sample_of, two_outputs, with_empty_samples)


def rows(batch):
    return [tuple(int(v) for v in sample) for sample in batch]


def test_batches_carry_sample_info_in_index_order():
    with ParallelSource(sample_of, 4, num_workers=2) as src:
        it = iter(src)
        first, second = next(it), next(it)
    assert rows(first) == [(k, k, 0, 0) for k in range(4)]
    assert rows(second) == [(4 + k, k, 1, 0) for k in range(4)]


@pytest.mark.parametrize("callback, offset", [(CalledSample(1), 1), (CalledSampleSubclass(5), 5),
                                              (StaticCall(), 2), (ClassCall(), 3)])
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_callback_object_is_called_as_its_class_defines(callback, offset, start_method):
    # A plain __call__ (the workers call it bound, once looked up), inherited, a staticmethod or
    # a classmethod one: each sample is what callback(info) gives.
    with ParallelSource(callback, 4, num_workers=2, start_method=start_method) as src:
        it = iter(src)
        batches = [next(it) for _ in range(3)]
    assert [rows(b) for b in batches] == [[(4 * i + k + offset, k + offset, i + offset, offset)
                                           for k in range(4)] for i in range(3)]


def test_each_loop_is_a_new_epoch_counted_from_zero():
    with ParallelSource(sample_of, 3, num_workers=2) as src:
        epochs = []
        for _ in range(3):
            for batch in src:
                epochs.append(rows(batch)[0])
                break
    assert [e[3] for e in epochs] == [0, 1, 2]
    assert all(e[0] == 0 for e in epochs)


def test_uniform_samples_form_one_dense_array_without_copy():
    with ParallelSource(sample_of, 8, num_workers=2) as src:
        it = iter(src)
        batches = [next(it) for _ in range(4)]
        last = batches[-1]
        assert isinstance(last, Batch) and last.is_dense
        dense = last.as_array()
        assert dense.shape == (8, 4)
        assert all(np.shares_memory(dense, sample) for sample in last)
        assert dense[:, 0].tolist() == list(range(24, 32))


def test_num_outputs_gives_a_tuple_of_batches_and_ragged_outputs_stay_lists():
    with ParallelSource(two_outputs, 5, num_outputs=2, num_workers=2) as src:
        it = iter(src)
        for _ in range(3):
            images, ragged = next(it)
    assert images.is_dense and images.as_array().shape == (5, 2, 3)
    assert images.as_array()[:, 0, 0].tolist() == list(range(10, 15))
    assert [r.shape for r in ragged] == [(k + 1,) for k in range(5)]
    assert not ragged.is_dense
    with pytest.raises(ValueError):
        ragged.as_array()


@pytest.mark.parametrize("workers", [1, 2])
def test_every_uniform_batch_is_dense_from_the_first(workers):
    with ParallelSource(two_outputs, 6, num_outputs=2, num_workers=workers) as src:
        it = iter(src)
        for i in range(3):
            images, ragged = next(it)
            assert images.is_dense and not ragged.is_dense
            assert images.as_array()[:, 0, 0].tolist() == list(range(6 * i, 6 * i + 6))
            assert all(np.shares_memory(images.as_array(), image) for image in images)


def test_batch_arrays_stay_valid_while_the_next_batch_is_taken():
    with ParallelSource(sample_of, 4, num_workers=2, prefetch=1) as src:
        it = iter(src)
        previous = next(it)
        for i in range(1, 12):
            current = next(it)
            assert rows(previous)[0][0] == (i - 1) * 4, "held batch was overwritten"
            previous = current


def test_batches_held_keeps_more_batches_alive():
    with ParallelSource(sample_of, 4, num_workers=2, batches_held=5) as src:
        it = iter(src)
        kept = [next(it) for _ in range(5)]
        assert [rows(b)[0][0] for b in kept] == [0, 4, 8, 12, 16]


def test_sample_info_is_an_immutable_named_tuple():
    info = SampleInfo(10, 2, 1, 0)
    assert info.idx_in_epoch == 10 and info.epoch_idx == 0
    with pytest.raises(AttributeError):
        info.iteration = 3


@pytest.mark.parametrize("workers", [1, 2])
def test_empty_samples_come_back_empty_even_as_the_first_ones_spilled(workers):
    with ParallelSource(with_empty_samples, 4, num_outputs=2, num_workers=workers) as src:
        it = iter(src)
        for iteration in range(4):
            ragged, scalars = next(it)
            expected = [np.arange(0 if iteration % 2 == 0 else k % 5, dtype=np.int16) + k
                        for k in range(4 * iteration, 4 * iteration + 4)]
            assert [(s.dtype, s.tolist()) for s in ragged] == [(e.dtype, e.tolist()) for e in expected]
            assert scalars.as_array().tolist() == list(range(4 * iteration, 4 * iteration + 4))


@pytest.mark.parametrize("num_workers", [1, 3])
def test_auto_outputs_are_learnt_from_the_workers_first_samples(num_workers):
    from extsrc import Order

    with ParallelSource(auto_outputs, 4, num_outputs="auto", num_workers=num_workers,
                        order=Order(10), last_batch="partial") as src:
        assert src.num_outputs == 0  # nothing came back yet
        for _ in range(2):
            batches = list(src)
            assert src.num_outputs == 3
            assert [len(b) for b in batches] == [3, 3, 3]
            vectors = np.concatenate([np.stack(b[0]) for b in batches])
            assert vectors.tolist() == [[i] * 3 for i in range(10)]
            assert [float(x) for b in batches for x in b[1]] == [float(i) for i in range(10)]
            assert [s.tolist() for b in batches for s in b[2]] == [list(range(i % 3)) for i in range(10)]
        assert batches[0][0].is_dense or num_workers > 1  # after the first results: in place


def test_auto_outputs_of_another_number_are_a_sample_error():
    from extsrc import Order
    from extsrc.errors import SampleError

    with ParallelSource(outputs_change_at_5, 4, num_outputs="auto", num_workers=1,
                        order=Order(8)) as src:
        it = iter(src)
        assert [len(next(it))] == [2]
        with pytest.raises(SampleError, match=r"expected a tuple of 2 outputs \(num_outputs='auto'"):
            next(it)


def test_auto_outputs_that_differ_between_workers_are_a_sample_error():
    from extsrc import Order
    from extsrc.errors import SampleError

    with ParallelSource(outputs_by_iteration, 2, num_outputs="auto", num_workers=2,
                        order=Order(8)) as src:
        with pytest.raises(SampleError, match=r"have [23] outputs, and earlier samples had [23]"):
            list(src)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_worker_init_runs_once_in_each_worker_before_its_samples(start_method):
    import os

    start = RecordsWorkerStart()
    with ParallelSource(ReturnsWorkerStart(start), 2, num_workers=2, start_method=start_method,
                        hooks=Hooks(worker_init=start)) as src:
        it = iter(src)
        rows = [tuple(int(v) for v in s) for _ in range(6) for s in next(it)]
    assert start.started is None  # not called in this process
    by_pid = {pid: (index, count) for index, count, pid in rows}
    assert sorted(by_pid.values()) == [(0, 2), (1, 2)] and os.getpid() not in by_pid
