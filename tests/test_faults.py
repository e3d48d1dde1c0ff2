"""Fault injection through the engine API: each fault in a fresh interpreter, with a time limit.

Every case asserts the message the user sees, the time from fault to error,
that no worker process outlives the run, and that /dev/shm gains no entry.
"""

import os
import signal

import pytest

from faultkit import HANG_GUARD_S, run_fault

pytestmark = pytest.mark.slow

ENGINE = '''
import os, signal, time
import numpy as np
import extsrc

def make_source(fault, at=9, **kwargs):
    def source(info):
        if info.idx_in_epoch == at:
            report.fault_starts()
            fault()
        return np.full((4,), info.idx_in_epoch, np.int32)
    return extsrc.ParallelSource(source, 8, num_workers=2, **kwargs)

def drain(src, report):
    src.start()
    report.pids(src.worker_pids())
    try:
        for _ in src:
            pass
    finally:
        src.close()
'''


def assert_clean(result):
    assert result.leftover_pids == [], f"workers outlived the run: {result.leftover_pids}"
    assert result.new_shm == [], f"/dev/shm entries left: {result.new_shm}"
    assert "Traceback" not in result.stderr, result.stderr


def engine_case(fault, **kwargs):
    args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    return ENGINE + f"\ndef run(report):\n    drain(make_source({fault}{args}), report)\n"


def test_callback_exception_names_the_sample_and_keeps_type_and_traceback():
    result = run_fault(engine_case("lambda: {}['no such key']"))
    assert result.type == "KeyError" and "no such key" in result.message
    assert "idx_in_epoch=9" in result.cause and "fault()" in result.cause
    assert_clean(result)


@pytest.mark.parametrize(
    "fault, expected",
    [
        ("lambda: os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL (signal 9)"),
        ("lambda: os.kill(os.getpid(), signal.SIGSEGV)", "killed by SIGSEGV (signal 11)"),
        ("lambda: os._exit(3)", "exited with code 3"),
    ],
)
def test_dead_worker_is_named_with_signal_and_samples_within_seconds(fault, expected):
    result = run_fault(engine_case(fault), timeout=30)
    assert result.type == "WorkerDiedError"
    assert expected in result.message
    assert "samples 0..7 of batch 1" in result.message and "idx_in_epoch 8..15" in result.message
    assert "remaining workers were shut down" in result.message
    assert result.seconds < HANG_GUARD_S  # reported, not hung
    assert_clean(result)


def test_callback_that_never_returns_times_out_naming_the_stuck_samples():
    result = run_fault(engine_case("lambda: time.sleep(3600)", timeout=1.5), timeout=30)
    assert result.type == "SourceTimeoutError"
    assert "timeout=1.5 s" in result.message and "samples 0..7 of batch 1" in result.message
    assert result.seconds < HANG_GUARD_S  # reported, not hung
    assert_clean(result)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_unpicklable_source_fails_at_start_with_advice(method):
    scenario = ENGINE + f'''
import threading
def run(report):
    lock = threading.Lock()
    src = extsrc.ParallelSource(lambda info: lock, 4, start_method={method!r})
    report.fault_starts()
    try:
        src.start()
    finally:
        src.close()
'''
    result = run_fault(scenario)
    assert result.type == "SourcePicklingError"
    assert "cannot pickle" in result.message and "lock" in result.message
    assert "pickle_by_value" in result.message and "dill" in result.message
    assert "start_method='fork'" in result.message
    assert_clean(result)


def test_bad_output_names_sample_output_expected_and_got():
    scenario = ENGINE + '''
def run(report):
    def source(info):
        report.fault_starts()
        return (np.zeros(2), "label") if info.idx_in_epoch == 5 else (np.zeros(2), np.ones(1))
    drain(extsrc.ParallelSource(source, 4, num_outputs=2, num_workers=2), report)
'''
    result = run_fault(scenario)
    assert result.type == "SampleError"
    assert "idx_in_epoch=5" in result.message and "output 1" in result.message
    assert "expected a NumPy array of numbers, got str 'label'" in result.message
    assert_clean(result)


LARGE = ENGINE + '''
def run(report):
    def large(info):
        report.fault_starts()
        sample = np.empty(4 << 20, np.uint8)
        sample[:8] = info.idx_in_batch
        return sample
    src = extsrc.ParallelSource(large, 16, num_workers=2)
    src.start()
    report.pids(src.worker_pids())
    with src:
        it = iter(src)
        for _ in range(4):
            batch = next(it)
        assert int(batch[5][0]) == 5
'''


def test_small_dev_shm_does_not_limit_memfd_buffers(small_dev_shm):
    result = run_fault(LARGE, wrap=small_dev_shm, timeout=60)
    assert result.type is None, result.traceback
    assert_clean(result)


def test_small_dev_shm_with_the_dev_shm_backend_fails_before_writing_with_the_size_to_use(small_dev_shm):
    result = run_fault(LARGE, wrap=small_dev_shm, env={"EXTSRC_SHM_BACKEND": "devshm"}, timeout=60)
    assert result.type == "SharedMemoryError", result.traceback
    assert "Nothing was reserved" in result.message  # checked before reserving any of it
    assert "/dev/shm has 16.0 MiB in all" in result.message
    assert "--shm-size=" in result.message and "needs about" in result.message
    assert "SIGBUS" not in result.message + result.stderr
    assert_clean(result)


def test_fork_after_cuda_is_initialised_is_refused_with_advice():
    scenario = ENGINE + '''
import extsrc.engine.processes
def run(report):
    extsrc.engine.processes.cuda_initialized = lambda: True  # as if a GPU library had run cuInit
    src = extsrc.ParallelSource(lambda info: np.zeros(1), 4)
    try:
        src.start()
    finally:
        src.close()
'''
    result = run_fault(scenario)
    assert result.type == "ForkAfterCudaError"  # a RuntimeError (tests/dali/test_dali_lifecycle.py)
    assert "CUDA is already initialised" in result.message
    assert "start_py_workers()" in result.message and "spawn" in result.message
    assert_clean(result)


# -- the same faults through the DALI drop-in -----------------------------------------------

DALI = '''
import json, multiprocessing, os, signal, time
import numpy as np
from extsrc import fn, pipeline_def

def make_pipe(fault, at=9, start_method="fork", **source_kwargs):
    def source(info):
        if info.idx_in_epoch == at:
            report.fault_starts()
            fault()
        return np.full((4,), info.idx_in_epoch, np.int32)

    @pipeline_def(batch_size=8, num_threads=1, device_id=None, py_num_workers=2,
                  py_start_method=start_method)
    def pipe():
        return fn.external_source(source=source, parallel=True, batch=False, **source_kwargs)

    return pipe()

def drive(pipe, report):
    pipe.start_py_workers()
    report.pids(pipe.extsrc_pool.worker_pids())
    try:
        pipe.build()
        for _ in range(50):
            pipe.run()
    finally:
        pipe.close()
'''


def dali_case(fault, **kwargs):
    args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    return DALI + f"\ndef run(report):\n    drive(make_pipe({fault}{args}), report)\n"


@pytest.fixture(scope="module")
def dali():
    return pytest.importorskip("nvidia.dali")


def test_dali_callback_exception_reaches_run_with_type_message_and_sample(dali):
    result = run_fault(dali_case("lambda: {}['no such key']"))
    assert result.type == "KeyError" and "no such key" in result.message, result.traceback
    assert "idx_in_epoch=9" in result.message + result.cause
    assert_clean(result)


@pytest.mark.parametrize(
    "fault, expected",
    [
        ("lambda: os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL (signal 9)"),
        ("lambda: os._exit(3)", "exited with code 3"),
    ],
)
def test_dali_dead_worker_is_named_not_interrupted(dali, fault, expected):
    result = run_fault(dali_case(fault), timeout=60)
    assert result.type == "WorkerDiedError", result.traceback
    assert expected in result.message and "idx_in_epoch 8..15" in result.message
    assert "Worker data receiving interrupted" not in result.message
    assert result.seconds < HANG_GUARD_S  # reported, not hung
    assert_clean(result)


def test_dali_timeout_names_the_stuck_samples(dali):
    result = run_fault(dali_case("lambda: time.sleep(3600)", timeout=1.5), timeout=60)
    assert result.type == "SourceTimeoutError", result.traceback
    assert "timeout=1.5 s" in result.message and "idx_in_epoch 8..15" in result.message
    assert result.seconds < HANG_GUARD_S  # reported, not hung
    assert_clean(result)


def test_dali_bad_output_names_sample_and_output(dali):
    scenario = DALI + '''
def run(report):
    @pipeline_def(batch_size=4, num_threads=1, device_id=None, py_num_workers=2)
    def pipe():
        def source(info):
            report.fault_starts()
            return (np.zeros(2), None) if info.idx_in_epoch == 5 else (np.zeros(2), np.ones(1))
        a, b = fn.external_source(source=source, num_outputs=2, parallel=True, batch=False)
        return a, b
    drive(pipe(), report)
'''
    result = run_fault(scenario)
    assert result.type == "SampleError", result.traceback
    assert "idx_in_epoch=5" in result.message and "output 1" in result.message
    assert "got None" in result.message
    assert_clean(result)


def test_dali_unpicklable_source_fails_at_build_with_advice(dali):
    scenario = DALI + '''
import threading
def run(report):
    lock = threading.Lock()
    pipe = make_pipe(lambda: None, start_method="spawn")
    @pipeline_def(batch_size=4, num_threads=1, device_id=None, py_num_workers=1,
                  py_start_method="spawn")
    def locked():
        return fn.external_source(source=lambda info: lock, parallel=True, batch=False)
    p = locked()
    report.fault_starts()
    try:
        p.build()
    finally:
        p.close()
        pipe.close()
'''
    result = run_fault(scenario)
    assert result.type == "SourcePicklingError", result.traceback
    assert "lock" in result.message and "pickle_by_value" in result.message
    assert_clean(result)


def test_dali_pipeline_left_open_at_exit_is_quiet(dali):
    scenario = DALI + '''
def run(report):
    pipe = make_pipe(lambda: None, at=-1)
    pipe.start_py_workers()
    report.pids(pipe.extsrc_pool.worker_pids())
    pipe.build()
    pipe.run()
'''
    result = run_fault(scenario)
    assert result.type is None, result.traceback
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert_clean(result)


DALI_LARGE = DALI + '''
def run(report):
    def large(info):
        report.fault_starts()
        sample = np.empty(4 << 20, np.uint8)
        sample[:8] = info.idx_in_batch
        return sample

    @pipeline_def(batch_size=16, num_threads=1, device_id=None, py_num_workers=2)
    def pipe():
        return fn.external_source(source=large, parallel=True, batch=False)

    p = pipe()
    p.start_py_workers()
    report.pids(p.extsrc_pool.worker_pids())
    with p:
        p.build()
        for _ in range(4):
            (out,) = p.run()
        assert int(np.asarray(out[5])[0]) == 5
'''


def test_dali_small_dev_shm_does_not_limit_memfd_buffers(dali, small_dev_shm):
    result = run_fault(DALI_LARGE, wrap=small_dev_shm, timeout=90)
    assert result.type is None, result.traceback
    assert_clean(result)


def test_dali_small_dev_shm_with_the_dev_shm_backend_names_the_shm_size(dali, small_dev_shm):
    result = run_fault(DALI_LARGE, wrap=small_dev_shm, env={"EXTSRC_SHM_BACKEND": "devshm"}, timeout=90)
    assert result.type == "SharedMemoryError", result.traceback
    assert "/dev/shm has 16.0 MiB in all" in result.message and "--shm-size=" in result.message
    assert_clean(result)


def test_dali_workers_exit_when_the_parent_is_killed(dali):
    scenario = DALI + '''
def run(report):
    pipe = make_pipe(lambda: time.sleep(0.2), at=3)
    pipe.start_py_workers()
    pids = pipe.extsrc_pool.worker_pids()
    report.pids(pids)
    pipe.build()
    print("RESULT " + json.dumps({"type": None, "message": None, "seconds": 0, "pids": pids}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
'''
    result = run_fault(scenario, timeout=60)
    assert result.returncode == -9
    assert result.pids and result.leftover_pids == [], "workers outlived their killed parent"
    assert result.new_shm == []


def test_engine_workers_exit_when_the_parent_is_killed():
    scenario = ENGINE + '''
import json
def run(report):
    src = make_source(lambda: time.sleep(0.2), at=3)
    src.start()
    pids = src.worker_pids()
    it = iter(src)
    print("RESULT " + json.dumps({"type": None, "message": None, "seconds": 0, "pids": pids}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
'''
    result = run_fault(scenario, timeout=60)
    assert result.returncode == -9
    assert result.pids and result.leftover_pids == [], "workers outlived their killed parent"
    assert result.new_shm == []


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_die_with_a_parent_killed_while_callbacks_hold_the_gil_in_c(method):
    # With forkserver a worker's parent is the fork server, which outlives the user's process.
    scenario = ENGINE + '''
import json
def hog(info):
    if info.idx_in_epoch >= 8:
        sum(range(10 ** 12))  # hours in C, holding the GIL: no Python thread of the worker can run
    return np.zeros(4)
def run(report):
    src = extsrc.ParallelSource(hog, 4, num_workers=2, start_method="METHOD")
    it = iter(src)
    next(it)
    pids = src.worker_pids()
    time.sleep(0.5)  # both workers are inside sum() now
    print("RESULT " + json.dumps({"type": None, "message": None, "seconds": 0, "pids": pids}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
'''.replace("METHOD", method)
    result = run_fault(scenario, timeout=60)
    for pid in result.leftover_pids:  # this test's own workers, spinning for hours otherwise
        os.kill(pid, signal.SIGKILL)
    assert result.returncode == -9
    assert result.pids and result.leftover_pids == [], "workers outlived their killed parent"
