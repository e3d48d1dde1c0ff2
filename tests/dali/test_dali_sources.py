"""Kinds of parallel sources in a DALI pipeline: modes, iterables, outputs, epochs, last batch."""

from __future__ import annotations

import time

import numpy as np
import pytest
from nvidia.dali import types

import extsrc
from extsrc import fn, pipeline_def
from dali_support import (
    BatchOfIteration,
    Counting,
    ImageAndLabel,
    as_lists,
    batches_generator,
    extsrc_workers,
    run_epoch,
    worker_pid,
)

CPU = dict(num_threads=1, device_id=None)


def test_sample_mode_sample_info_and_epochs():
    @pipeline_def(batch_size=3, py_num_workers=2, **CPU)
    def pipe():
        return fn.external_source(Counting(7), parallel=True, batch=False)

    with pipe() as p:
        epochs = []
        for _ in range(3):
            epochs.append(as_lists(run_epoch(p)))
            with pytest.raises(StopIteration):
                p.run()  # stays at the end until reset()
            p.reset()
    for epoch_idx, epoch in enumerate(epochs):
        assert epoch == [
            [[[it * 3 + k, k, it, epoch_idx] for k in range(3)]] for it in range(2)
        ]


def test_batch_mode_dense_and_list_batches():
    @pipeline_def(batch_size=4, py_num_workers=1, **CPU)
    def pipe():
        dense = fn.external_source(BatchOfIteration(4, 2, dense=True), parallel=True, batch=True)
        listed = fn.external_source(
            BatchOfIteration(4, 2), parallel=True, batch=True, batch_info=True
        )
        return dense, listed

    with pipe() as p:
        run_epoch(p)
        p.reset()
        got = as_lists(run_epoch(p))
    assert [it[0] for it in got] == [[[i, k, 0] for k in range(4)] for i in range(2)]  # int arg
    assert [it[1] for it in got] == [[[i, k, 1] for k in range(4)] for i in range(2)]  # BatchInfo


def test_generator_function_source_restarts_each_epoch_with_cycle_raise():
    @pipeline_def(batch_size=2, py_num_workers=1, **CPU)
    def pipe():
        return fn.external_source(batches_generator, parallel=True, batch=True, cycle="raise")

    with pipe() as p:
        epochs = [as_lists(run_epoch(p)), None]
        p.reset()
        epochs[1] = as_lists(run_epoch(p))
    expected = [[[list(range(i + 1)), list(range(i + 2))]] for i in range(3)]
    assert epochs == [expected, expected]


def test_iterable_without_cycle_is_read_once():
    data = [[np.full((2,), i, np.int16), np.full((3,), i, np.int16)] for i in range(2)]

    @pipeline_def(batch_size=2, py_num_workers=1, **CPU)
    def pipe():
        return fn.external_source(data, parallel=True, batch=True)

    with pipe() as p:
        first = as_lists(run_epoch(p))
        p.reset()
        second = run_epoch(p)
    assert first == [[[[0, 0], [0, 0, 0]]], [[[1, 1], [1, 1, 1]]]]
    assert second == []  # as in DALI: the data was gone through once


def test_iterable_cycle_quiet_never_ends_an_epoch():
    data = [[np.array([i], np.int32)] for i in range(3)]

    @pipeline_def(batch_size=1, py_num_workers=1, **CPU)
    def pipe():
        return fn.external_source(data, parallel=True, batch=True, cycle="quiet")

    with pipe() as p:
        got = [int(np.array(p.run()[0][0])[0]) for _ in range(8)]
    assert got == [0, 1, 2, 0, 1, 2, 0, 1]


def test_num_outputs_with_ragged_output():
    @pipeline_def(batch_size=3, py_num_workers=2, **CPU)
    def pipe():
        images, labels = fn.external_source(
            ImageAndLabel(6), num_outputs=2, parallel=True, batch=False, dtype=[types.UINT8, types.INT32]
        )
        return images, labels

    with pipe() as p:
        iterations = run_epoch(p)
    assert len(iterations) == 2
    for it, (images, labels) in enumerate(iterations):
        for k in range(3):
            i = it * 3 + k
            assert images[k].shape == (2 + i % 3, 3, 3) and (images[k] == i).all()
            assert labels[k].tolist() == [i * 10]


def test_num_outputs_one_gives_a_list_of_one_node():
    @pipeline_def(batch_size=2, py_num_workers=1, **CPU)
    def pipe():
        nodes = fn.external_source(lambda info: (np.array([info.idx_in_epoch]),), num_outputs=1, parallel=True, batch=False)
        assert isinstance(nodes, list) and len(nodes) == 1
        return nodes[0]

    with pipe() as p:
        assert as_lists([tuple(map(list, map(np.array, p.run())))]) == [[[[0], [1]]]]


def test_sources_of_a_pipeline_share_one_pool():
    @pipeline_def(batch_size=4, py_num_workers=2, **CPU)
    def pipe():
        a = fn.external_source(worker_pid, parallel=True, batch=False)
        b = fn.external_source(worker_pid, parallel=True, batch=False)
        c = fn.external_source(BatchOfIteration(4, 100), parallel=True, batch=True)
        return a, b, c

    with pipe() as p:
        p.build()
        workers = extsrc_workers()
        assert len(workers) == 2
        pids = set()
        for _ in range(4):
            a, b, _ = p.run()
            pids |= {int(np.array(a[i])[0]) for i in range(4)} | {int(np.array(b[i])[0]) for i in range(4)}
        assert pids <= set(workers) and set(workers) == set(p.extsrc_pool.worker_pids())
    assert extsrc_workers() == []


@pytest.mark.parametrize("last_batch, sizes", [("partial", [4, 4, 2]), ("drop", [4, 4])])
def test_last_batch(last_batch, sizes):
    @pipeline_def(batch_size=4, py_num_workers=2, **CPU)
    def pipe():
        return fn.external_source(Counting(10), parallel=True, batch=False, last_batch=last_batch)

    with pipe() as p:
        for epoch in range(2):
            iterations = run_epoch(p)
            p.reset()
            assert [len(it[0]) for it in iterations] == sizes
            flat = [s.tolist() for it in iterations for s in it[0]]
            assert [s[0] for s in flat] == list(range(sum(sizes)))
            assert {s[3] for s in flat} == {epoch}


def test_partial_batch_goes_through_dali_operators():
    @pipeline_def(batch_size=4, py_num_workers=1, **CPU)
    def pipe():
        x = fn.external_source(Counting(6), parallel=True, batch=False, last_batch="partial", dtype=types.INT64)
        return fn.cast(x, dtype=types.FLOAT) * 0.5

    with pipe() as p:
        last = run_epoch(p)[-1][0]
    assert [s.tolist() for s in last] == [[2.0, 0.0, 0.5, 0.0], [2.5, 0.5, 0.5, 0.0]]


def test_declared_dtype_and_layout_are_checked_in_the_worker():
    @pipeline_def(batch_size=2, py_num_workers=1, **CPU)
    def wrong_dtype():
        return fn.external_source(Counting(4), parallel=True, batch=False, dtype=types.FLOAT)

    with wrong_dtype() as p:
        with pytest.raises(extsrc.SampleError, match="expected dtype float32"):
            p.run()

    @pipeline_def(batch_size=2, py_num_workers=1, **CPU)
    def wrong_layout():
        return fn.external_source(Counting(4), parallel=True, batch=False, layout="HWC")

    with wrong_layout() as p:
        with pytest.raises(extsrc.SampleError, match="expected 3 dimensions"):
            p.run()


def test_layout_reaches_dali():
    @pipeline_def(batch_size=2, py_num_workers=1, **CPU)
    def pipe():
        return tuple(fn.external_source(ImageAndLabel(4), num_outputs=2, parallel=True, batch=False, layout=["HWC"]))

    with pipe() as p:
        images, labels = p.run()
    assert images.layout() == "HWC" and labels.layout() == ""


def test_an_in_place_source_writes_its_samples_into_shared_memory_through_the_drop_in():
    def fill(info, buffers):
        out = buffers.array((2, 3), np.int32)
        out[...] = info.idx_in_epoch
        return out

    @pipeline_def(batch_size=4, py_num_workers=2, **CPU)
    def pipe():
        return fn.external_source(fill, parallel=True, batch=False, in_place=True)

    with pipe() as p:
        p.build()
        got = [[int(np.array(out[i])[1, 2]) for i in range(4)] for (out,) in (p.run() for _ in range(3))]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_a_pipeline_reports_the_statistics_of_each_parallel_source():
    def slow(info):
        time.sleep(0.005)
        return np.zeros(8, np.uint8)

    @pipeline_def(batch_size=4, py_num_workers=2, **CPU)
    def pipe():
        return fn.external_source(slow, parallel=True, batch=False, name="images")

    with pipe() as p:
        p.build()
        for _ in range(6):
            p.run()
        stats = p.extsrc_stats()
    assert list(stats) == ["images"]
    assert stats["images"].samples >= 24 and stats["images"].diagnosis().startswith(("Input-bound", "Machine busy"))


def test_dali_asking_again_for_the_batch_it_was_handed_gets_the_same_batch():
    # DALI counts an iteration after the feeder returned its batch; an exception (an interrupt)
    # in between makes it ask for the same BatchInfo again. An iterable cannot rewind: handing
    # the next batch then would skip one.
    from nvidia.dali.types import BatchInfo

    from dali_support import RewindingBatches
    from extsrc.dali.feeder import CYCLE_OFF, Feeder

    with extsrc.ParallelSource(RewindingBatches(2, 4), 2, batch=True, num_workers=1) as source:
        feeder = Feeder(source, callable_source=False, cycle=CYCLE_OFF, keep=3, original=None)
        first = [s.tolist() for s in feeder(BatchInfo(0, 0))]
        again = [s.tolist() for s in feeder(BatchInfo(0, 0))]
        following = [s.tolist() for s in feeder(BatchInfo(0, 1))]
        feeder.release()
    assert first == again == [[0, 0, 0], [0, 0, 1]]
    assert following == [[0, 1, 0], [0, 1, 1]]
