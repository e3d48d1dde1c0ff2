"""The drop-in behaves as the installed DALI does where a DALI user can see it.

Each test states one behaviour of DALI 2.4's parallel external source (checked
against DALI itself where it can run here) that a pipeline moved to extsrc by
changing its imports must keep.
"""

import warnings

import numpy as np
import nvidia.dali
import pytest

import extsrc
from extsrc import fn, pipeline_def

from dali_support import (
    Counting,
    OnePassBatches,
    PicklerRefusingKwargs,
    RewindingBatches,
    as_lists,
    echo_argument,
    run_epoch,
    samples_of,
)

CPU = dict(num_threads=1, device_id=None)


def test_py_num_workers_none_is_accepted_without_parallel_sources():
    # DALI's tests build their reference pipelines with py_num_workers=None.
    @pipeline_def(batch_size=2, py_num_workers=None, **CPU)
    def pipe():
        return fn.external_source([[np.array([1]), np.array([2])]], cycle="raise")

    with pipe() as p:
        (out,) = p.run()
        assert [s.tolist() for s in samples_of(out)] == [[1], [2]]
        assert p.py_num_workers is None


@pytest.mark.parametrize("workers", [None, 0])
def test_a_parallel_source_without_workers_fails_with_dalis_words(workers):
    @pipeline_def(batch_size=2, py_num_workers=workers, **CPU)
    def pipe():
        return fn.external_source(Counting(4), parallel=True, batch=False)

    with pytest.raises(RuntimeError, match="cannot run in parallel mode without Python workers pool"):
        pipe().build()


def test_without_batch_the_source_is_called_as_dali_calls_it():
    # DALI 2.4's fn.external_source defaults to batch=True with parallel=True as well: the
    # callback gets the iteration number. Same batches as DALI's own parallel source.
    def outputs(api_fn, api_pipeline_def):
        @api_pipeline_def(batch_size=2, py_num_workers=1, py_start_method="fork", **CPU)
        def pipe():
            return api_fn.external_source(echo_argument, parallel=True)

        p = pipe()
        p.build()
        got = [samples_of(p.run()[0]) for _ in range(3)]
        return [[s.tolist() for s in batch] for batch in got]

    ours = outputs(fn, pipeline_def)
    dalis = outputs(nvidia.dali.fn, nvidia.dali.pipeline_def)
    assert ours == dalis == [[[1, i], [1, i]] for i in range(3)]


def test_an_iterable_whose_iter_rewinds_itself_gives_a_new_pass_every_epoch():
    # DALI calls iter() on the source again after each reset(); the object rewinds and
    # returns itself. Three epochs, each a full pass, numbered by the pass.
    @pipeline_def(batch_size=2, py_num_workers=1, **CPU)
    def pipe():
        return fn.external_source(RewindingBatches(2, 3), parallel=True, batch=True, cycle="raise")

    with pipe() as p:
        epochs = []
        for _ in range(3):
            epochs.append(as_lists(run_epoch(p)))
            p.reset()
    for number, epoch in enumerate(epochs):
        assert epoch == [[[[number, i, k] for k in range(2)]] for i in range(3)]


def test_an_iterator_that_cannot_rewind_gives_empty_epochs_as_in_dali():
    # iter() on it returns it unchanged: after its one pass, DALI ends each epoch at once.
    @pipeline_def(batch_size=2, py_num_workers=1, **CPU)
    def pipe():
        return fn.external_source(OnePassBatches(2, 2), parallel=True, batch=True, cycle="quiet")

    with pipe() as p:
        assert len(run_epoch(p)) == 2
        for _ in range(2):
            p.reset()
            with pytest.raises(StopIteration):
                p.run()


def test_shm_statistics_report_the_memory_of_the_parallel_sources():
    batch_size = 4

    @pipeline_def(batch_size=batch_size, py_num_workers=2, **CPU)
    def pipe():
        return fn.external_source(lambda info: np.zeros(1000, np.uint8), parallel=True, batch=False)

    p = pipe()
    with p:
        assert p.external_source_shm_statistics() == {"capacities": [], "per_sample_capacities": []}
        p.run()
        stats = p.external_source_shm_statistics()
        assert stats["capacities"], "memory holding the prepared batches"
        assert all(c >= batch_size * 1000 for c in stats["capacities"])
        assert stats["per_sample_capacities"] == [c // batch_size for c in stats["capacities"]]
    assert p.external_source_shm_statistics()["capacities"] == []  # closed: all given back


def test_an_error_of_the_users_pickler_reaches_the_user_as_its_own_type():
    @pipeline_def(batch_size=2, py_num_workers=1, py_start_method="spawn",
                  py_callback_pickler=PicklerRefusingKwargs, **CPU)
    def pipe():
        return fn.external_source(Counting(4), parallel=True, batch=False)

    p = pipe()
    try:
        with pytest.raises(ValueError, match="this pickler needs token=7"):
            p.build()
    finally:
        p.close()


@pytest.mark.parametrize(
    "source, batch, dali_phrase",
    [
        (lambda: np.zeros(2), False,
         "Callable passed to External Source in parallel mode (when `parallel=True`) must accept "
         "exactly one argument"),
        (lambda a, b, c: np.zeros(2), False,
         "The `source` callable must accept either 0 or 1 positional arguments to indicate whether "
         "it accepts the batch or sample indexing information. Found more than one positional "
         "argument, which is not allowed."),
        ([[np.zeros(2)]], False, "Parallel external source with an iterable must be run in a batch mode"),
    ],
)
def test_argument_errors_keep_dalis_sentence(source, batch, dali_phrase):
    @pipeline_def(batch_size=2, py_num_workers=1, **CPU)
    def pipe():
        return fn.external_source(source, parallel=True, batch=batch)

    with pytest.raises(TypeError) as info:
        pipe()
    assert dali_phrase in str(info.value)


def test_the_checkpointing_warning_for_an_iterable_keeps_dalis_words():
    @pipeline_def(batch_size=2, py_num_workers=1, enable_checkpointing=True, **CPU)
    def pipe():
        return fn.external_source(RewindingBatches(2, 2), parallel=True, batch=True, cycle="raise")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = pipe()
    p.close()
    assert any("DALI doesn't capture state of such 'source'" in str(w.message) for w in caught)


def test_pipeline_is_importable_from_extsrc_for_the_legacy_api():
    from extsrc import Pipeline

    pipe = Pipeline(batch_size=3, py_num_workers=1, **CPU)
    with pipe:
        pipe.set_outputs(fn.external_source(Counting(6), parallel=True, batch=False))
    try:
        pipe.build()
        (out,) = pipe.run()
        assert [s.tolist()[0] for s in samples_of(out)] == [0, 1, 2]
    finally:
        pipe.close()
    assert issubclass(Pipeline, nvidia.dali.Pipeline) and extsrc.Pipeline is Pipeline


def test_an_iterable_cut_short_by_another_source_goes_on_after_reset_as_in_dali():
    # The epoch ends when the callable source ends (3 batches); reset() does not rewind the
    # iterable (5 batches per pass), which goes on where it was, as DALI's parallel source does.
    def epochs(api_fn, api_pipeline_def):
        @api_pipeline_def(batch_size=2, py_num_workers=1, py_start_method="fork", **CPU)
        def pipe():
            short = api_fn.external_source(Counting(6), parallel=True, batch=False)
            long = api_fn.external_source(RewindingBatches(2, 5), parallel=True, batch=True, cycle="raise")
            return short, long

        p = pipe()
        p.build()
        got = []
        for _ in range(4):
            got.append([])
            while True:
                try:
                    short, long = p.run()
                except StopIteration:
                    p.reset()
                    break
                # [pass, position, k]: compare positions (how often iter() runs in the parent
                # before the workers start differs from DALI and carries no data)
                got[-1].append((samples_of(short)[0].tolist()[0], samples_of(long)[0].tolist()[1]))
        return got

    ours = epochs(fn, pipeline_def)
    dalis = epochs(nvidia.dali.fn, nvidia.dali.pipeline_def)
    assert ours == dalis
    assert ours[1][0][1] != 0, "the reset() did not rewind the iterable"
