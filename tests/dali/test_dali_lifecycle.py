"""Pipeline life cycle: workers, start methods and pickling, fork after CUDA, checkpoints, close."""

from __future__ import annotations

import gc
import os
import weakref

import dill
import numpy as np
import nvidia.dali
import pytest
from nvidia.dali import types

import extsrc
from extsrc import fn, pipeline_def
from dali_support import Counting, as_lists, extsrc_workers, run_epoch, samples_of
from faultkit import run_isolated

CPU = dict(num_threads=1, device_id=None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pipeline_def(batch_size=2, py_num_workers=2, **CPU)
def counting(n=6):
    return fn.external_source(Counting(n), parallel=True, batch=False)


def test_close_stops_workers_and_is_idempotent():
    p = counting()
    p.build()
    pids = extsrc_workers()
    assert len(pids) == 2
    assert len(run_epoch(p)) == 3
    p.close()
    p.close()
    assert extsrc_workers() == [] and not any(_alive(pid) for pid in pids)
    with pytest.raises(extsrc.PoolClosedError, match="closed"):
        p.run()
    with pytest.raises(extsrc.PoolClosedError):
        p.build()


def test_context_manager_closes():
    with counting() as p:
        assert p.run()[0] is not None
        assert len(extsrc_workers()) == 2
    assert extsrc_workers() == []
    with pytest.raises(extsrc.PoolClosedError):
        p.run()


def test_close_before_build_and_garbage_collection_leave_nothing():
    counting().close()  # sources were defined, no worker ever started
    p = counting()
    p.build()
    assert len(extsrc_workers()) == 2
    del p
    gc.collect()
    assert extsrc_workers() == []


def test_workers_start_before_dali_builds_and_dalis_pool_is_never_used(monkeypatch):
    started = []
    original_init = nvidia.dali.Pipeline._init_pipeline_backend

    def spy(self):
        started.append(len(extsrc_workers()))
        return original_init(self)

    monkeypatch.setattr(nvidia.dali.Pipeline, "_init_pipeline_backend", spy)
    with counting() as p:
        p.run()
        assert started == [2]  # the workers existed before DALI's backend was created
        assert p._py_pool is None and not p._py_pool_started


def test_dalis_own_parallel_external_source_is_refused():
    @pipeline_def(batch_size=2, **CPU)
    def pipe():
        return nvidia.dali.fn.external_source(Counting(4), parallel=True, batch=False)

    with pipe() as p:
        with pytest.raises(TypeError, match="extsrc.fn.external_source"):
            p.build()


def test_fork_after_cuda_is_refused_with_advice_and_dalis_sentence(monkeypatch):
    monkeypatch.setattr("extsrc.engine.processes.cuda_initialized", lambda: True)
    with counting() as p:
        with pytest.raises(RuntimeError, match=r"start_py_workers\(\).*spawn") as refused:
            p.build()
    assert extsrc_workers() == []
    assert isinstance(refused.value, extsrc.ForkAfterCudaError)
    # A search for DALI's message (and DALI's own test of it) finds extsrc's.
    assert str(refused.value).startswith(
        "Cannot fork a process when the CUDA has been initialized in the process. extsrc ")


def test_start_py_workers_before_cuda_then_build(monkeypatch):
    with counting() as p:
        p.start_py_workers()
        monkeypatch.setattr("extsrc.engine.processes.cuda_initialized", lambda: True)  # e.g. torch.cuda.init()
        p.build()
        assert len(run_epoch(p)) == 3


def test_spawn_with_lambda_and_closure_default_pickler():
    offset = 1000

    def scaled(info):  # a closure, pickled by value
        return np.array([info.idx_in_epoch * 2 + offset], dtype=np.int64)

    @pipeline_def(batch_size=2, py_num_workers=1, py_start_method="spawn", **CPU)
    def pipe():
        a = fn.external_source(lambda info: np.array([info.idx_in_batch], np.int32), parallel=True, batch=False)
        b = fn.external_source(scaled, parallel=True, batch=False)
        return a, b

    with pipe() as p:
        a, b = p.run()
    assert as_lists([(samples_of(a), samples_of(b))]) == [[[[0], [1]], [[1000], [1002]]]]


def test_spawned_workers_do_not_import_dali():
    # A worker only runs the callback: importing DALI there (~0.35 s per spawned worker here)
    # made build() to the first batch slower than DALI's own parallel source.
    import sys

    def dali_here(info):
        return np.array([int("nvidia.dali" in sys.modules)], dtype=np.int32)

    @pipeline_def(batch_size=2, py_num_workers=1, py_start_method="spawn", **CPU)
    def pipe():
        return fn.external_source(dali_here, parallel=True, batch=False)

    with pipe() as p:
        (out,) = p.run()
    assert [np.array(out[i]).tolist() for i in range(2)] == [[0], [0]]


def test_spawn_with_dill_pickler():
    table = {0: 7, 1: 8, 2: 9, 3: 10}

    def lookup(info):
        return np.array([table[info.idx_in_epoch % 4]], dtype=np.int64)

    @pipeline_def(
        batch_size=4, py_num_workers=1, py_start_method="spawn",
        py_callback_pickler=(dill, {"recurse": True}), **CPU,
    )
    def pipe():
        return fn.external_source(lookup, parallel=True, batch=False)

    with pipe() as p:
        (out,) = p.run()
    assert [np.array(out[i]).tolist() for i in range(4)] == [[7], [8], [9], [10]]


def test_pickler_with_fork_is_refused_like_dali():
    with pytest.raises(ValueError, match="py_callback_pickler"):
        counting(py_callback_pickler=dill)


def test_bad_start_method_is_refused():
    with pytest.raises(ValueError, match="py_start_method"):
        counting(py_start_method="thread")


def test_zero_workers_only_for_pipelines_without_parallel_sources():
    @pipeline_def(batch_size=2, py_num_workers=0, **CPU)
    def plain():
        return fn.external_source(lambda: np.zeros((2, 1), np.float32))

    with plain() as p:
        assert np.array(p.run()[0].as_tensor()).shape == (2, 1)
    with pytest.raises(RuntimeError, match="py_num_workers"):
        counting(py_num_workers=0)


def test_forkserver():
    with counting(py_start_method="forkserver") as p:
        assert [len(it[0]) for it in run_epoch(p)] == [2, 2, 2]


def test_checkpointing_an_iterable_source_warns():
    data = [[np.zeros(1, np.float32)]] * 2

    @pipeline_def(batch_size=1, enable_checkpointing=True, **CPU)
    def pipe():
        return fn.external_source(data, parallel=True, batch=True)

    with pytest.warns(Warning, match="starts its epoch from the beginning"):
        pipe().close()


@pipeline_def(batch_size=3, py_num_workers=2, enable_checkpointing=True, **CPU)
def checkpointed():
    x = fn.external_source(Counting(15), parallel=True, batch=False, dtype=types.INT64)
    noise = fn.random.uniform(range=[0.0, 1.0], shape=[2], seed=7)
    return x, noise


def _rest_of_run(p, epochs: int) -> list:
    """What the pipeline gives from now on: the rest of this epoch, then ``epochs`` more."""
    out = [as_lists(run_epoch(p))]
    for _ in range(epochs):
        p.reset()
        out.append(as_lists(run_epoch(p)))
    return out


@pytest.mark.parametrize("epoch, taken", [(0, 2), (1, 4), (0, 0)])
def test_checkpoint_resumes_exactly(epoch, taken):
    with checkpointed() as p:
        for _ in range(epoch):
            run_epoch(p)
            p.reset()
        for _ in range(taken):
            p.run()
        saved = p.checkpoint()
        expected = _rest_of_run(p, 1)
    with checkpointed(checkpoint=saved) as restored:
        got = _rest_of_run(restored, 1)
    assert got == expected
    first = got[0][0][0] if got[0] else None
    assert first == [[3 * taken + k, k, taken, epoch] for k in range(3)]


def _spawn_pipe(source):
    @pipeline_def(batch_size=2, py_num_workers=1, py_start_method="spawn", **CPU)
    def pipe():
        return fn.external_source(source, parallel=True, batch=False)

    return pipe()


def test_default_pickler_refuses_a_function_its_module_lost_as_dali_does(monkeypatch):
    import pickle

    import dali_support

    # The module no longer holds the function under its name: DALI's default pickler refuses it
    # (rather than sending a copy that would run with copies of the module's globals).
    monkeypatch.setattr(dali_support.index_sample, "__name__", "renamed_sample")
    monkeypatch.setattr(dali_support.index_sample, "__qualname__", "renamed_sample")
    p = _spawn_pipe(dali_support.index_sample)
    with pytest.raises(pickle.PicklingError, match="attribute lookup renamed_sample on dali_support failed"):
        p.build()
    p.close()
    assert extsrc_workers() == []


def test_dalis_by_value_mark_sends_such_a_function_by_value(monkeypatch):
    import dali_support
    from nvidia.dali.pickling import pickle_by_value

    source = dali_support.marked_index_sample
    monkeypatch.setattr(source, "_dali_pickle_by_value", False, raising=False)  # undone after the test
    pickle_by_value(source)
    monkeypatch.setattr(source, "__name__", "renamed_marked")
    monkeypatch.setattr(source, "__qualname__", "renamed_marked")
    with _spawn_pipe(source) as p:
        (out,) = p.run()
    assert [s.tolist() for s in samples_of(out)] == [[0], [1]]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_script_that_leaves_its_pipeline_open_exits(method):
    # The usual short job: a pipeline at module level, built, run, never closed. Its clean-up
    # then runs while the interpreter shuts down, when no daemon thread runs any more.
    out = run_isolated(
        f"""
        import numpy as np
        from extsrc import fn, pipeline_def

        def sample(info):
            return np.full(4, info.idx_in_epoch, np.int32)

        @pipeline_def(batch_size=4, num_threads=1, device_id=None, py_num_workers=2,
                      py_start_method="{method}")
        def pipeline():
            return fn.external_source(source=sample, batch=False, parallel=True)

        if __name__ == "__main__":
            pipe = pipeline()
            pipe.build()
            (out,) = pipe.run()
            print("FIRST", [int(np.asarray(out[i])[0]) for i in range(len(out))], flush=True)
        """,
        timeout=90,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "FIRST [0, 1, 2, 3]" in out.stdout


class _OnePass:
    """An iterable whose __iter__ does not start a new pass (it ends for good after 2 batches)."""

    def __init__(self):
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.count == 2:
            raise StopIteration
        self.count += 1
        return [np.full(3, self.count, np.int32)] * 2


@pytest.mark.parametrize("cycle", ["quiet", None])
def test_a_pipeline_whose_source_ended_is_freed_with_its_last_reference(cycle):
    # As DALI's: the workers stop when the user's last reference goes, not when the garbage
    # collector happens to run (an exception of the ended epoch held the pipeline in a cycle).
    def epoch_past_its_end():
        pipe = extsrc.Pipeline(batch_size=2, py_num_workers=1, **CPU)
        with pipe:
            pipe.set_outputs(fn.external_source(_OnePass(), parallel=True, batch=True, cycle=cycle))
        pipe.build()
        for _ in range(2):
            pipe.run()
        for _ in range(2):
            with pytest.raises(StopIteration):
                pipe.run()
            pipe.reset()
        return weakref.ref(pipe)

    gc.collect()
    gc.disable()
    try:
        pipe = epoch_past_its_end()
        assert pipe() is None
        assert extsrc_workers() == []
    finally:
        gc.enable()


# close() cut short by a Ctrl-C at each place one can land in the pipeline's close steps (its
# run thread, DALI's shutdown, the feeders), then called again with the pipeline still held: the
# second call finishes the job. Before, the first call marked the pipeline closed on entry and the
# second returned at once, leaving the workers and the run thread. In its own interpreter.
_INTERRUPTED_CLOSES = '''
import _thread, os
import numpy as np
import extsrc
from extsrc import fn, pipeline_def
from interrupting import cut_at_landing
from procs import live_children

DALI_LAYER = os.path.join(os.path.dirname(extsrc.__file__), "dali")


def sample(info):
    return np.full(4, info.idx_in_epoch, np.int32)


@pipeline_def(batch_size=2, py_num_workers=2, num_threads=1, device_id=None)
def pipeline():
    return fn.external_source(sample, parallel=True, batch=False)


threads = _thread._count()
walked = interrupted = 0
while True:
    walked += 1
    p = pipeline()
    p.build()
    p.run()
    cut, over = cut_at_landing(walked, DALI_LAYER, p.close)
    interrupted += cut
    p.close()
    assert live_children() == [], (walked, live_children())
    assert _thread._count() == threads, (walked, _thread._count())
    del p
    if over:
        break
print("WALKED", walked > 3, "INTERRUPTED", interrupted == walked - 1)
'''


@pytest.mark.slow
def test_a_close_interrupted_wherever_a_ctrl_c_can_land_is_finished_by_the_next_close():
    result = run_isolated(_INTERRUPTED_CLOSES, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "WALKED True INTERRUPTED True" in result.stdout, result.stdout


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_build_starts_making_the_first_batches_before_the_first_run(tmp_path, start_method):
    # DALI's own parallel source starts working at the first run() (NVIDIA/DALI#5583): with
    # extsrc, build() (or start_py_workers()) does, so a model compiled meanwhile waits for
    # nothing. The batches made early are the ones run() gives, none made twice.
    from sources import MarksOnce, wait_for_files

    @pipeline_def(batch_size=4, py_num_workers=2, py_start_method=start_method, **CPU)
    def pipe():
        return fn.external_source(MarksOnce(str(tmp_path)), parallel=True, batch=False,
                                  order=extsrc.Order(16))

    with pipe() as p:
        p.build()
        assert wait_for_files(str(tmp_path), 8) >= 8  # two batches' samples, before any run()
        firsts = [int(np.array(p.run()[0].at(0))[0]) for _ in range(4)]
    assert firsts == [0, 4, 8, 12]
