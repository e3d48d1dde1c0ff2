"""Errors of a parallel source reach the user from run(), with their own type and message."""

from __future__ import annotations

import numpy as np
import nvidia.dali
import pytest

import extsrc
from extsrc import fn, pipeline_def
from sources import FailsOn, minus_record
from dali_support import (
    Counting,
    dies_at_3,
    extsrc_workers,
    fails_at_5,
    float_sample,
    returns_a_string,
    run_epoch,
    sleeps,
)

CPU = dict(num_threads=1, device_id=None)


def _pipe(source, **es_kwargs):
    @pipeline_def(batch_size=4, py_num_workers=2, **CPU)
    def pipe():
        return fn.external_source(source, parallel=True, **{"batch": False, **es_kwargs})

    return pipe()


def test_callback_exception_keeps_type_message_and_worker_traceback():
    with _pipe(fails_at_5) as p:
        with pytest.raises(KeyError, match="no record for sample 5 in the index") as info:
            p.run()
        assert "fails_at_5" in str(info.value.__cause__)  # the worker's traceback


def test_dead_worker():
    with _pipe(dies_at_3) as p:
        with pytest.raises(extsrc.WorkerDiedError, match="exited with code 3"):
            p.run()
        with pytest.raises(extsrc.PoolClosedError, match="WorkerDiedError"):
            p.run()
    assert extsrc_workers() == []


def test_invalid_sample():
    with _pipe(returns_a_string) as p:
        with pytest.raises(extsrc.SampleError, match="str"):
            p.run()


def test_declared_dtype():
    from nvidia.dali import types

    with _pipe(float_sample, dtype=types.INT32) as p:
        with pytest.raises(extsrc.SampleError, match="expected dtype int32"):
            p.run()


def big_endian(info):  # as FITS files and some instruments give them
    return (np.arange(3) + info.idx_in_epoch).astype(">f4")


def big_endian_ragged(info):
    return (np.arange(1 + info.idx_in_epoch % 3) + info.idx_in_epoch).astype(">f4")


def complex_sample(info):
    return np.full(2, 1 + 2j * info.idx_in_epoch, np.complex64)


def long_double(info):
    return np.full(2, info.idx_in_epoch, np.longdouble)


@pytest.mark.parametrize("source, match", [
    (big_endian, r"output 0 has samples of dtype float32 \(big-endian, '>f4'\), which DALI reads "
                 r"in this machine's byte order.*x.astype\(x.dtype.newbyteorder\('='\)\)"),
    (big_endian_ragged, r"output 0, sample 0 of the batch, has dtype float32 \(big-endian"),
    (complex_sample, r"output 0 has samples of dtype complex64, which DALI has no type for"),
    (long_double, r"output 0 has samples of dtype float\d+, which DALI has no type for.*long double"),
], ids=["dense-big-endian", "ragged-big-endian", "complex", "long-double"])
def test_a_dtype_dali_would_read_as_other_numbers_is_refused(source, match):
    # DALI's own external source hands these bytes on as other numbers, without an error.
    with _pipe(source) as p:
        for _ in range(2):  # and again when run() asks for the batch again
            with pytest.raises(TypeError, match=match):
                p.run()


def test_timeout():
    with _pipe(sleeps, timeout=0.5) as p:
        with pytest.raises(extsrc.SourceTimeoutError, match="timeout=0.5"):
            p.run()
    assert extsrc_workers() == []


def test_a_failed_batch_is_asked_for_again_by_the_next_run():
    def flaky(info):
        if info.epoch_idx == 0 and info.idx_in_epoch == 2:
            raise ValueError("transient")
        if info.idx_in_epoch >= 8:
            raise StopIteration
        return np.array([info.idx_in_epoch, info.epoch_idx], np.int64)

    with _pipe(flaky) as p:
        with pytest.raises(ValueError, match="transient"):
            p.run()
        # DALI asks for the failed batch again, which fails again, deterministically.
        with pytest.raises(ValueError, match="transient"):
            p.run()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(source=lambda: np.zeros(2)), TypeError, "must accept exactly one argument"),
        (dict(source=[np.zeros((1, 2))], batch=False), TypeError, "must be run in a batch mode"),
        (dict(source=Counting(4), no_copy=False), ValueError, "no_copy"),
        (dict(source=Counting(4), prefetch_queue_depth=0), ValueError, "prefetch_queue_depth"),
        (dict(source=Counting(4), cycle="raise"), ValueError, "cycle"),
        (dict(source=Counting(4), cycle="sometimes"), ValueError, "cycle"),
        (dict(source=Counting(4), last_batch="keep"), ValueError, "last_batch"),
        (dict(source=None), ValueError, "needs a `source`"),
    ],
)
def test_invalid_arguments_are_refused_at_definition(kwargs, error, match):
    @pipeline_def(batch_size=2, **CPU)
    def pipe():
        return fn.external_source(parallel=True, **{"batch": False, **kwargs})

    with pytest.raises(error, match=match):
        pipe()
    assert extsrc_workers() == []


def test_extsrc_options_need_parallel():
    @pipeline_def(batch_size=2, **CPU)
    def pipe():
        return fn.external_source(lambda: np.zeros((2, 1)), last_batch="partial")

    with pytest.raises(ValueError, match="parallel=True"):
        pipe()


def test_non_parallel_errors_are_dalis():
    @pipeline_def(batch_size=2, **CPU)
    def pipe():
        return fn.external_source(lambda: np.zeros((2, 1)), prefetch_queue_depth=2)

    with pytest.raises(ValueError, match="valid only for parallel external sources"):
        pipe()


def test_a_source_defined_after_the_workers_started_is_refused():
    with _pipe(Counting(8)) as p:
        p.build()
        nvidia.dali.Pipeline.push_current(p)
        try:
            with pytest.raises(RuntimeError, match="after the pipeline's workers started"):
                fn.external_source(Counting(8), parallel=True, batch=False)
        finally:
            nvidia.dali.Pipeline.pop_current()
        assert len(run_epoch(p)) == 2


def test_asking_for_a_gpu_where_there_is_none_says_so():
    from extsrc.engine.cuda_state import gpu_visible

    if gpu_visible()[0]:
        pytest.skip("a GPU is visible here")

    @pipeline_def(batch_size=2, num_threads=1, device_id=0, py_num_workers=1)
    def pipe():
        return fn.external_source(source=float_sample, parallel=True, batch=False)

    p = pipe()
    try:
        with pytest.raises(RuntimeError, match=r"device_id=0\) needs a GPU, but .*device_id=None") as caught:
            p.build()
        assert caught.value.__cause__ is None and caught.value.__suppress_context__
    finally:
        p.close()


def test_a_source_converted_for_conditionals_is_refused_with_dalis_phrase():
    # With enable_conditionals=True, a function defined inside the pipeline is converted by
    # AutoGraph, which cannot run in a worker; DALI refuses it, and code matching DALI's phrase
    # must find it in extsrc's refusal too.
    @pipeline_def(batch_size=4, py_num_workers=1, py_start_method="spawn", enable_conditionals=True, **CPU)
    def pipe():
        def local_source(info):
            return np.full((3,), info.idx_in_epoch, np.int32)

        return fn.external_source(source=local_source, parallel=True, batch=False)

    with pytest.raises(ValueError) as info:
        pipe()
    message = str(info.value)
    assert "To allow the `source` to be correctly used" in message
    assert "it must remain unconverted" in message
    assert "do_not_convert" in message  # and how to keep it so
    # extsrc's own code ran as written (as DALI's does), not converted for conditionals.
    import traceback

    converted = [frame.name for frame in traceback.extract_tb(info.tb) if frame.name.startswith("autograph__")]
    assert converted == ["autograph__pipe"], converted


def test_on_error_skip_hands_dali_full_batches_without_the_bad_sample():
    with _pipe(FailsOn(16, (5,)), on_error="skip", last_batch="partial") as p:
        batches = [np.array(p.run()[0].as_tensor())[:, 0].tolist() for _ in range(4)]
        # Record 5 left out, the batches after it refilled from the next: DALI gets full ones.
        assert batches == [[0, 1, 2, 3], [4, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15]]
        assert [[f.record for f in faults] for faults in p.extsrc_faults().values()] == [[5]]
    with _pipe(FailsOn(16, (5,)), on_error=minus_record) as p:
        p.run()
        assert np.array(p.run()[0].as_tensor())[:, 0].tolist() == [4, -5, 6, 7]


def test_a_checkpoint_after_a_skip_resumes_at_the_same_records():
    @pipeline_def(batch_size=4, py_num_workers=2, enable_checkpointing=True, **CPU)
    def pipe():
        return fn.external_source(FailsOn(40, (5, 22)), parallel=True, batch=False,
                                  on_error="skip", last_batch="partial")

    def records(p, n):
        return [np.array(p.run()[0].as_tensor())[:, 0].tolist() for _ in range(n)]

    with pipe() as p:
        head = records(p, 3)  # past record 5: the batches after it hold the next records
        saved = p.checkpoint()
        rest = records(p, 6)
    with pipe(checkpoint=saved) as restored:
        assert records(restored, 6) == rest
    good = [r for r in range(40) if r not in (5, 22)]
    assert sum(head + rest, []) == good[:36]


def test_on_error_needs_parallel():
    with pytest.raises(ValueError, match="`on_error`"):
        fn.external_source(lambda info: np.zeros(2), batch=False, on_error="skip")


def test_py_worker_restarts_replaces_a_lost_worker_and_run_goes_on(tmp_path):
    from sources import KillsItsWorker

    (tmp_path / "kill-0").touch()

    @pipeline_def(batch_size=4, py_num_workers=2, py_worker_restarts=1, **CPU)
    def pipe():
        return fn.external_source(KillsItsWorker(40, 13, str(tmp_path)), parallel=True, batch=False)

    with pipe() as p:
        got = [int(x) for _ in range(10) for x in np.array(p.run()[0].as_tensor())[:, 0]]
        assert got == list(range(40))
        assert not (tmp_path / "kill-0").exists()  # a worker did die


def test_py_worker_restarts_is_checked():
    with pytest.raises(ValueError, match="py_worker_restarts must be an int >= 0"):
        extsrc.dali.Pipeline(batch_size=1, py_worker_restarts=-2, **CPU)
