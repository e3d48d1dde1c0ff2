"""Two threads calling ``run()`` of one pipeline at once: the second gets a clear error naming
both threads; the first's batches are all there, in order. (Before, the second thread took the
first's batch and the first failed with an internal assertion.) Runs in its own interpreter."""

from faultkit import run_fault

TWO_THREADS = '''
import threading, time
import numpy as np
from extsrc import fn, pipeline_def

class Slow:
    def __call__(self, info):
        time.sleep(0.01)  # both threads get inside run() while a batch is made
        return np.array([info.idx_in_epoch], np.int64)

@pipeline_def(batch_size=2, py_num_workers=2, num_threads=1, device_id=None)
def pipe():
    return fn.external_source(Slow(), parallel=True, batch=False)

def run(report):
    p = pipe()
    p.build()
    report.pids(p.extsrc_pool.worker_pids())
    got = {0: [], 1: []}
    errors = []
    both_in = threading.Barrier(2)
    def loop(k):
        both_in.wait()
        for _ in range(10):
            try:
                got[k] += np.array(p.run()[0].as_array()).ravel().tolist()
            except Exception as exc:
                errors.append(exc)
                return
    threads = [threading.Thread(target=loop, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    values = sorted(got[0] + got[1])
    assert values == list(range(len(values))), got  # no batch lost or given twice
    for k in (0, 1):
        assert all(got[k][i] + 1 == got[k][i + 1] for i in range(0, len(got[k]), 2)), got
    p.close()
    if errors:
        raise errors[0]
'''


def test_a_second_thread_in_run_is_refused_and_no_batch_goes_astray():
    result = run_fault(TWO_THREADS)
    assert result.type in (None, "RuntimeError"), result.traceback or result.stderr
    if result.type == "RuntimeError":  # the threads met inside run(): the usual case
        assert "called too" in result.message and "one thread at a time" in result.message
    assert result.leftover_pids == []
