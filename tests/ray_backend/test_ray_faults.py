"""Faults of the Ray backend, each in a fresh interpreter with its own local Ray and a time limit.

Each case checks the message the consumer sees, the time from the fault to
the error, and that no actor process outlives the run.
"""

import pytest

from faultkit import HANG_GUARD_S, run_fault

pytestmark = pytest.mark.ray

RAY_ENGINE = '''
import os, signal, sys, time
import numpy as np
import ray
import extsrc

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

def started(src, report, workers=2):
    """Starts the actors and reports their pids (they must all be gone after the run)."""
    it = iter(src)
    next(it)
    deadline = time.monotonic() + 60
    while len(src.worker_pids()) < workers and time.monotonic() < deadline:
        time.sleep(0.01)
    report.pids(src.worker_pids())
    return it
'''
FAULT_TIMEOUT_S = 120  # the interpreter, a local Ray (several seconds on 2 CPUs) and the case


def ray_case(body):
    return RAY_ENGINE + "\ndef run(report):\n" + "".join(f"    {line}\n" for line in body.splitlines())


def assert_clean(result):
    assert result.pids, "the scenario reported no actor pids"
    assert result.leftover_pids == [], f"actors outlived the run: {result.leftover_pids}"
    assert result.new_shm == [], f"/dev/shm entries left: {result.new_shm}"


def test_an_actor_killed_with_ray_kill_mid_epoch_is_named_with_its_node_and_samples():
    result = run_fault(ray_case('''
go = f"/tmp/extsrc-ray-kill-{os.getpid()}"  # made once the actors' pids are reported
def load(info):
    while info.idx_in_epoch >= 8 and not os.path.exists(go):
        time.sleep(0.01)
    if info.idx_in_epoch == 9:
        ray.kill(ray.get_runtime_context().current_actor)
        time.sleep(60)
    return np.full((4,), info.idx_in_epoch, np.int32)
src = extsrc.ParallelSource(load, 8, pool=extsrc.PoolSpec(num_workers=2, backend="ray"))
it = started(src, report)
report.fault_starts()
open(go, "w").close()
try:
    for _ in it:
        pass
finally:
    os.unlink(go)
'''), timeout=FAULT_TIMEOUT_S)
    assert result.type == "WorkerDiedError", result.stderr
    message = result.message
    assert "extsrc ray worker" in message and "Ray actor " in message
    assert "on node " in message and "node id " in message
    assert "samples 0..7 of batch 1 of epoch 0 (idx_in_epoch 8..15)" in message
    assert "killed by `ray.kill`" in message and "remaining workers were shut down" in message
    assert result.seconds < HANG_GUARD_S  # reported, not hung
    assert_clean(result)


def test_an_actor_process_killed_by_a_signal_is_reported_within_seconds():
    result = run_fault(ray_case('''
def load(info):
    if info.idx_in_epoch >= 16:
        time.sleep(60)  # every actor holds samples when one is killed
    return np.full((4,), info.idx_in_epoch, np.int32)
src = extsrc.ParallelSource(load, 8, pool=extsrc.PoolSpec(num_workers=2, backend="ray"))
it = started(src, report)
next(it)
report.fault_starts()
os.kill(src.worker_pids()[1], signal.SIGKILL)
next(it)
'''), timeout=FAULT_TIMEOUT_S)
    assert result.type == "WorkerDiedError", result.stderr
    assert "extsrc ray worker 1 (Ray actor" in result.message
    assert "died while it held samples 0..7 of batch" in result.message
    assert result.seconds < HANG_GUARD_S  # reported, not hung
    assert_clean(result)


def test_a_timeout_kills_the_actors_and_names_the_stuck_samples():
    result = run_fault(ray_case('''
def load(info):
    if info.idx_in_epoch == 12:
        time.sleep(3600)
    return np.zeros(2)
# 5 s: the actors' calls before the stuck one stay well inside it on a busy machine
src = extsrc.ParallelSource(load, 4, pool=extsrc.PoolSpec(num_workers=2, backend="ray"), timeout=5)
it = started(src, report)
report.fault_starts()
for _ in it:
    pass
'''), timeout=FAULT_TIMEOUT_S)
    assert result.type == "SourceTimeoutError", result.stderr
    assert "timeout=5 s" in result.message and "samples 0..3 of batch 3" in result.message
    assert result.seconds < HANG_GUARD_S  # reported, not hung
    assert_clean(result)


def test_ray_shut_down_under_a_source_is_an_error_not_a_hang():
    result = run_fault(ray_case('''
def load(info):
    if info.idx_in_epoch >= 8:
        time.sleep(60)
    return np.zeros(2)
src = extsrc.ParallelSource(load, 4, pool=extsrc.PoolSpec(num_workers=2, backend="ray"))
it = started(src, report)
report.fault_starts()
ray.shutdown()
for _ in it:
    pass
'''), timeout=FAULT_TIMEOUT_S)
    assert result.type == "WorkerDiedError", result.stderr
    assert "no longer connected to Ray" in result.message
    assert result.seconds < HANG_GUARD_S  # reported, not hung
    assert_clean(result)


def test_actors_no_node_has_room_for_are_an_error_that_says_what_they_asked():
    result = run_fault(ray_case('''
import extsrc.ray.backend
extsrc.ray.backend.ACTOR_START_TIMEOUT_S = 3  # instead of minutes: nothing will come
pool = extsrc.WorkerPool(2, backend="ray", ray_options={"resources": {"tpu_pod": 1}})
src = extsrc.ParallelSource(lambda info: np.zeros(1), 4, pool=pool)
report.fault_starts()
next(iter(src))
'''), timeout=FAULT_TIMEOUT_S)
    assert result.type == "RuntimeError", result.stderr
    assert "was not running 3 s after start()" in result.message
    assert "resources={'tpu_pod': 1}" in result.message and "2 of 2 CPU free" in result.message
    assert result.seconds < HANG_GUARD_S  # reported, not hung


def test_sources_the_actors_cannot_load_are_reported_with_the_traceback():
    result = run_fault(ray_case('''
class Broken:
    def __init__(self):
        self.path = "/data/index"
    def __call__(self, info):
        return np.zeros(1)
    def __setstate__(self, state):
        raise OSError(f"cannot open {state['path']} on this node")
src = extsrc.ParallelSource(Broken(), 4, pool=extsrc.PoolSpec(num_workers=2, backend="ray"))
report.fault_starts()
next(iter(src))
'''), timeout=FAULT_TIMEOUT_S)
    assert result.type == "RuntimeError", result.stderr
    assert "extsrc ray worker" in result.message and "could not load the sources" in result.message
    assert "cannot open /data/index on this node" in result.message and "__setstate__" in result.message
    assert result.seconds < HANG_GUARD_S  # reported, not hung
