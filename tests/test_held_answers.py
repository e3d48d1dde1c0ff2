"""Workers hold back the answer of a short task to send it with the next one (see
extsrc.engine.sender): a finished batch must still reach the consumer when the task after
it never finishes (a sample waiting on storage that does not answer)."""

from faultkit import run_isolated

# Each run hangs from another batch on, so that some hang lands right after an answer held
# back (answers go in pairs: which ones are held depends on timing).
SCRIPT = """
import os, sys, tempfile, time
import numpy as np
import extsrc
from script_helpers import HANG_GUARD_S

gate = tempfile.mkdtemp()

def make(hang_from):
    def callback(info):
        if info.iteration >= hang_from:
            flag = os.path.join(gate, str(hang_from))
            while not os.path.exists(flag):  # hangs until the consumer has its batches
                time.sleep(0.005)
        return np.full(4, info.idx_in_epoch, np.int64)
    return callback

for hang_from in range(2, 10):
    with extsrc.ParallelSource(make(hang_from), 64, num_workers=1, start_method="fork",
                               prefetch=8) as source:
        batches = iter(source)
        got = [int(next(batches)[0][0]) // 64 for _ in range(hang_from)]
        assert got == list(range(hang_from)), got
        open(os.path.join(gate, str(hang_from)), "w").close()
        assert int(next(batches)[0][0]) // 64 == hang_from
print("ok")
"""


def test_a_finished_batch_arrives_while_the_next_task_hangs():
    done = run_isolated(SCRIPT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
