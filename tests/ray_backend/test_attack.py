"""backend="ray" under attack: cases where Ray actors give other batches than worker processes,
or fail otherwise than they do. Each test fails on the code it was written against.
"""

from __future__ import annotations

import numpy as np
import pytest

from extsrc import ParallelSource

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
    kwargs = dict(source=RefillsOneBuffer(1 << 20), batch_size=4, num_workers=2)
    theirs = _firsts(**kwargs)
    assert theirs == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    ours = _firsts(backend="ray", **kwargs)
    assert ours == theirs


_AFTER_SHUTDOWN = r'''
import numpy as np, ray, extsrc
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

def load(info):
    if info.idx_in_epoch >= 8:
        raise StopIteration
    return np.full(4, info.idx_in_epoch, np.int64)

src = extsrc.ParallelSource(load, 4, num_workers=2, backend="ray")
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
with extsrc.ParallelSource(lambda info: np.full(2, info.idx_in_epoch), 2, num_workers=1,
                           backend="ray") as fresh:
    print("FRESH", next(iter(fresh)).as_array()[:, 0].tolist(), flush=True)
ray.shutdown()
'''


def test_ray_shut_down_between_epochs_is_an_error_without_starting_another_ray():
    # After ray.shutdown() the next epoch's first call from the pool's I/O thread hits Ray's
    # auto-init (ActorMethod.remote): a new local Ray is started behind the user's back, in
    # that thread. When the thread ends (the pool broke), Ray's processes die with it (their
    # parent-death signal follows the thread), so the next use of Ray kills this process
    # ("The connection to the plasma store is failed. Terminate the process.", exit status 1)
    # and Ray's agents are left running. Expected: the WorkerDiedError, Ray left as the user
    # left it, and a new source works once the user starts Ray again.
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _AFTER_SHUTDOWN], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        try:  # what Ray left behind in the script's session (the orphaned agents)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert "ERROR WorkerDiedError" in out, out + err
    assert "RAY INITIALIZED False" in out, out
    assert "FRESH [0, 1]" in out and proc.returncode == 0, f"rc {proc.returncode}\n{out}\n{err[-2000:]}"
