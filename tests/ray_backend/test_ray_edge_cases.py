"""backend="ray" where Ray itself makes a difference: a callback refilling one large buffer (the
actor must not send it after the next sample changed it), ray.shutdown() under a source (no new
Ray started behind the user's back), a local Ray started from a thread that ends (it must live on).
"""

from __future__ import annotations

import numpy as np
import pytest

from extsrc import ParallelSource, PoolSpec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("local_ray")]


def _firsts(batches=3, **kwargs):
    """The first value of every sample of the first ``batches`` batches."""
    out = []
    with ParallelSource(**kwargs) as src:
        it = iter(src)
        for _ in range(batches):
            out.append([int(sample[0]) for sample in next(it)])
    return out


class RefillsOneBuffer:
    """Returns the same large array for every sample, refilled with the sample's index: a loader
    that decodes each sample into one reusable buffer. Worker processes write each sample of a
    MiB or more into shared memory as soon as it is made (streaming), so this is safe there."""

    def __init__(self, sample_bytes: int):
        self.sample_bytes = sample_bytes
        self.buffer = None

    def __getstate__(self):
        return {"sample_bytes": self.sample_bytes, "buffer": None}

    def __call__(self, info):
        if self.buffer is None:
            self.buffer = np.zeros(self.sample_bytes, np.uint8)
        self.buffer[:] = info.idx_in_epoch % 251
        return self.buffer


def test_a_callback_that_refills_one_large_buffer_per_sample_gives_what_processes_give():
    # README: "An answer never holds the callback's memory: a callback that reuses its buffers
    # gives the same batches as with worker processes." The actor keeps the streamed chunks
    # (lists of the callback's arrays) until the task ends and copies them only then, so every
    # sample of a task comes back as the task's last one.
    kwargs = dict(source=RefillsOneBuffer(1 << 20), batch_size=4)
    theirs = _firsts(num_workers=2, **kwargs)
    assert theirs == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    ours = _firsts(pool=PoolSpec(num_workers=2, backend="ray"), **kwargs)
    assert ours == theirs


_AFTER_SHUTDOWN = r'''
import numpy as np, ray, extsrc
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

def load(info):
    if info.idx_in_epoch >= 8:
        raise StopIteration
    return np.full(4, info.idx_in_epoch, np.int64)

src = extsrc.ParallelSource(load, 4, pool=extsrc.PoolSpec(num_workers=2, backend="ray"))
assert len(list(src)) == 2  # one epoch; the actors now hold nothing
ray.shutdown()
try:
    list(src)  # the next epoch, on actors of a Ray that is gone
    print("NO ERROR", flush=True)
except extsrc.WorkerDiedError as exc:
    print("ERROR", type(exc).__name__, flush=True)
print("RAY INITIALIZED", ray.is_initialized(), flush=True)
src.close()
if not ray.is_initialized():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
with extsrc.ParallelSource(lambda info: np.full(2, info.idx_in_epoch), 2,
                           pool=extsrc.PoolSpec(num_workers=1, backend="ray")) as fresh:
    print("FRESH", next(iter(fresh)).as_array()[:, 0].tolist(), flush=True)
ray.shutdown()
'''


def _run_script(code, timeout=90):
    """Runs ``code`` in a fresh interpreter in a session of its own, then kills whatever Ray left
    in that session. Returns (returncode, stdout, stderr)."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:  # what Ray left behind in the script's session (orphaned agents, actors)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, out, err


def test_ray_shut_down_between_epochs_is_an_error_without_starting_another_ray():
    # After ray.shutdown() the next epoch's first call from the pool's I/O thread hits Ray's
    # auto-init (ActorMethod.remote): a new local Ray is started behind the user's back, in
    # that thread. When the thread ends (the pool broke), Ray's processes die with it (their
    # parent-death signal follows the thread), so the next use of Ray kills this process
    # ("The connection to the plasma store is failed. Terminate the process.", exit status 1)
    # and Ray's agents are left running. Expected: the WorkerDiedError, Ray left as the user
    # left it, and a new source works once the user starts Ray again.
    rc, out, err = _run_script(_AFTER_SHUTDOWN)
    assert "ERROR WorkerDiedError" in out, out + err
    assert "RAY INITIALIZED False" in out, out
    assert "FRESH [0, 1]" in out and rc == 0, f"rc {rc}\n{out}\n{err[-2000:]}"


_FIRST_USE_IN_A_THREAD = r"""
import threading, time
import numpy as np, extsrc

def load(info):
    return np.full(2, info.idx_in_epoch, np.int64)

# No ray.init(): "the first Ray source starts a local Ray on this host" (README).
src = extsrc.ParallelSource(load, 4, pool=extsrc.PoolSpec(num_workers=2, backend="ray"))
box = {}

def first_batch():  # e.g. a loader thread that starts the data, then hands over
    box["it"] = iter(src)
    box["first"] = next(box["it"]).as_array()[:, 0].tolist()

thread = threading.Thread(target=first_batch)
thread.start()
thread.join()
print("FIRST", box["first"], flush=True)
time.sleep(1)
src.close()
with extsrc.ParallelSource(load, 4, pool=extsrc.PoolSpec(num_workers=1, backend="ray")) as fresh:
    print("FRESH", next(iter(fresh)).as_array()[:, 0].tolist(), flush=True)
"""


def test_a_source_first_used_in_a_thread_that_ends_leaves_ray_usable():
    # The Ray backend's start() calls ray.init() in whatever thread first iterates the source. Ray's
    # processes get a parent-death signal tied to that thread: when it ends, the local Ray dies
    # under the pool. close() then waits for actors that Ray cannot report (seconds), and the
    # next Ray source kills the process (plasma store gone, exit status 1), leaving Ray's
    # agents running. Expected: the local Ray lives as long as the process, as with ray.init()
    # in the main thread.
    rc, out, err = _run_script(_FIRST_USE_IN_A_THREAD)
    assert "FIRST [0, 1, 2, 3]" in out, out + err[-2000:]
    assert "FRESH [0, 1, 2, 3]" in out and rc == 0, f"rc {rc}\n{out}\n{err[-2000:]}"
