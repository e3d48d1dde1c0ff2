"""worker_restarts= on the Ray backend: a lost actor is replaced by a new one where Ray places
it, its tasks redone, the epoch whole and in order; past the budget, WorkerDiedError. Each case
runs in a fresh interpreter with its own local Ray."""

import json

import pytest

from faultkit import HANG_GUARD_S, run_fault

pytestmark = pytest.mark.ray

KILLER = '''
import glob, json, os, signal, time
import numpy as np
import ray
import extsrc

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
marks = f"/tmp/extsrc-ray-restart-{os.getpid()}"
os.makedirs(marks, exist_ok=True)

def load(info):
    """Records 0..199; at record 123 the actor's process SIGKILLs itself while a mark is left
    (one mark taken per kill), every time with MARKS < 0."""
    if info.idx_in_epoch >= 200:
        raise StopIteration
    if info.idx_in_epoch == 123:
        left = sorted(glob.glob(os.path.join(marks, "kill-*")))
        if left or MARKS < 0:
            if left:
                os.unlink(left[0])
            os.kill(os.getpid(), signal.SIGKILL)
    return np.full(2, info.idx_in_epoch, np.int64)

def run(report):
    for k in range(max(MARKS, 0)):
        open(os.path.join(marks, f"kill-{k}"), "w").close()
    pool = extsrc.WorkerPool(2, backend="ray", worker_restarts=RESTARTS)
    seen = set()
    try:
        with pool, extsrc.ParallelSource(load, 8, pool=pool) as src:
            epochs = []
            report.fault_starts()
            for _ in range(2):
                records = []
                for batch in src:
                    records += [int(sample[0]) for sample in batch]
                    seen.update(src.worker_pids())
                epochs.append(records)
            print("EPOCHS " + json.dumps([epochs, pool.restarts, src.stats().worker_restarts]), flush=True)
    finally:
        seen.update(pool.worker_pids())
        report.pids(sorted(seen))
        for path in glob.glob(os.path.join(marks, "*")):
            os.unlink(path)
        os.rmdir(marks)
'''


def _case(marks: int, restarts: int) -> str:
    return f"MARKS = {marks}\nRESTARTS = {restarts}\n" + KILLER


def test_an_actor_killed_mid_task_is_replaced_and_both_epochs_are_whole_and_in_order():
    result = run_fault(_case(marks=1, restarts=1), timeout=180)
    assert result.type is None, result.stderr[-3000:]
    line = next(text for text in result.stdout.splitlines() if text.startswith("EPOCHS "))
    epochs, restarts, counted = json.loads(line[len("EPOCHS "):])
    assert epochs == [list(range(200)), list(range(200))]
    assert len(restarts) == 1 and "extsrc ray worker" in restarts[0] and counted == 1
    assert result.leftover_pids == [], f"actors outlived the run: {result.leftover_pids}"


def test_a_callback_that_kills_every_actor_ends_in_an_error_not_a_restart_loop():
    result = run_fault(_case(marks=-1, restarts=1), timeout=180)
    assert result.type == "WorkerDiedError", result.stderr[-3000:]
    assert "extsrc ray worker" in result.message
    assert "replaced 1 lost worker(s) before, worker_restarts=1" in result.traceback
    assert result.seconds < HANG_GUARD_S
    assert result.leftover_pids == [], f"actors outlived the run: {result.leftover_pids}"
