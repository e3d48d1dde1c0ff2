"""Moving a pipeline to extsrc by changing its imports gives the same data."""

from __future__ import annotations

import numpy as np
import nvidia.dali
import nvidia.dali.fn as dali_fn
import pytest
from nvidia.dali import types

import extsrc
import extsrc.dali
from dali_support import BatchOfIteration, Counting, ImageAndLabel, as_lists, run_epoch

PIPE_ARGS = dict(batch_size=4, num_threads=1, device_id=None, py_num_workers=2)


def _epochs(pipe, count: int) -> list:
    epochs = []
    for _ in range(count):
        epochs.append(as_lists(run_epoch(pipe)))
        pipe.reset()
    return epochs


def _sample_pipeline(fn, pipeline_def):
    @pipeline_def(**PIPE_ARGS)
    def pipe():
        images, labels = fn.external_source(
            ImageAndLabel(10), num_outputs=2, parallel=True, batch=False,
            dtype=[types.UINT8, types.INT32], layout=["HWC", ""],
        )
        flipped = fn.flip(images, horizontal=1)
        return images, fn.cast(labels, dtype=types.INT64) + 1, flipped

    return pipe()


def test_sample_mode_same_outputs_as_dali_parallel_external_source():
    dali_pipe = _sample_pipeline(nvidia.dali.fn, nvidia.dali.pipeline_def)
    dali_pipe.build()
    expected = _epochs(dali_pipe, 2)
    del dali_pipe

    with _sample_pipeline(extsrc.fn, extsrc.pipeline_def) as pipe:
        got = _epochs(pipe, 2)

    assert got == expected
    assert len(got[0]) == 2  # 10 samples, batch 4, DALI drops the partial batch
    assert got[1][0][1][0] == [1 + 0 * 10 + 1]  # label of sample 0 in epoch 1, cast and +1


def test_batch_mode_same_outputs_as_dali():
    def make(fn, pipeline_def):
        @pipeline_def(**PIPE_ARGS)
        def pipe():
            a = fn.external_source(BatchOfIteration(4, 3), parallel=True, batch=True)
            b = fn.external_source(BatchOfIteration(4, 3), parallel=True, batch=True, batch_info=True)
            return a, b

        return pipe()

    dali_pipe = make(nvidia.dali.fn, nvidia.dali.pipeline_def)
    dali_pipe.build()
    expected = _epochs(dali_pipe, 2)
    del dali_pipe
    with make(extsrc.fn, extsrc.pipeline_def) as pipe:
        got = _epochs(pipe, 2)
    assert got == expected
    assert got[1][2][1][3] == [2, 3, 1]  # BatchInfo carried the epoch


def test_non_parallel_external_source_is_dalis():
    data = [np.full((4, 2), i, dtype=np.float32) for i in range(3)]

    @extsrc.pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def pipe():
        return extsrc.fn.external_source(data, cycle="raise")

    with pipe() as p:
        first = as_lists(run_epoch(p))
        p.reset()
        second = as_lists(run_epoch(p))
    assert first == second == [[[[float(i)] * 2] * 4] for i in range(3)]


def test_fn_namespace_is_dalis_apart_from_external_source():
    assert extsrc.fn.decoders.image is dali_fn.decoders.image
    assert extsrc.fn.resize is dali_fn.resize
    assert extsrc.fn.readers.file is dali_fn.readers.file
    assert extsrc.fn.external_source is not dali_fn.external_source
    assert "decoders" in dir(extsrc.fn)
    with pytest.raises(AttributeError):
        getattr(extsrc.fn, "no_such_operator")  # noqa: B009 (the attribute access is the test)


@extsrc.pipeline_def
def bare(n):
    return extsrc.fn.external_source(Counting(n), parallel=True, batch=False)


@extsrc.pipeline_def(batch_size=2, num_threads=1, device_id=None, py_num_workers=1)
def with_args(n):
    return extsrc.fn.external_source(Counting(n), parallel=True, batch=False)


def test_pipeline_def_with_and_without_arguments_and_call_time_overrides():
    with bare(8, batch_size=4, num_threads=1, device_id=None, py_num_workers=2) as p:
        assert isinstance(p, nvidia.dali.Pipeline) and isinstance(p, extsrc.dali.Pipeline)
        assert (p.max_batch_size, p.num_threads, p.device_id, p.py_num_workers) == (4, 1, None, 2)
        assert [len(it[0]) for it in run_epoch(p)] == [4, 4]
    with with_args(8) as p:
        assert p.max_batch_size == 2 and p.py_num_workers == 1
        assert len(run_epoch(p)) == 4
    with with_args(8, batch_size=8, py_start_method="spawn") as p:
        assert p.max_batch_size == 8 and p.py_start_method == "spawn"
        assert len(run_epoch(p)) == 1


def test_dali_pipeline_arguments_pass_through():
    @extsrc.pipeline_def(
        batch_size=2, num_threads=1, device_id=None, prefetch_queue_depth=3, seed=123,
        exec_dynamic=False, output_dtype=types.INT64, output_ndim=1,
    )
    def pipe():
        return extsrc.fn.external_source(Counting(6), parallel=True, batch=False)

    with pipe() as p:
        assert p.prefetch_queue_depth == 3 and p.seed == 123 and not p.exec_dynamic
        assert as_lists(run_epoch(p))[2] == [[[4, 0, 2, 0], [5, 1, 2, 0]]]


def test_legacy_pipeline_api():
    pipe = extsrc.dali.Pipeline(batch_size=3, num_threads=1, device_id=None, py_num_workers=1)
    with pipe:  # graph definition: makes it current, does not close it
        pipe.set_outputs(extsrc.fn.external_source(Counting(6), parallel=True, batch=False))
    with pipe:  # a defined pipeline: closed on exit
        assert [len(it[0]) for it in run_epoch(pipe)] == [3, 3]
    with pytest.raises(extsrc.PoolClosedError):
        pipe.run()


def test_parallel_source_needs_an_extsrc_pipeline():
    @nvidia.dali.pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def pipe():
        return extsrc.fn.external_source(Counting(4), parallel=True, batch=False)

    with pytest.raises(TypeError, match="from extsrc import pipeline_def"):
        pipe()
