"""A close() cut short by a KeyboardInterrupt (Ctrl-C at any line of it) is finished by the next
close(): workers, the I/O thread and descriptors are gone after it. (Before, the second close()
returned at once and left them all until the interpreter's exit.) Runs in its own interpreter."""

from faultkit import run_fault

INTERRUPTED_CLOSES = '''
import _thread, asyncio, os, sys, threading
import numpy as np
import extsrc
from extsrc import ParallelSource

EXTSRC = os.path.dirname(extsrc.__file__)

class Slow:
    async def __call__(self, info):  # tasks overlap: some are in flight at close()
        await asyncio.sleep(0.05)
        return np.full(64, info.idx_in_epoch, np.int64)

def interrupt_at_call(k):
    """A trace function raising KeyboardInterrupt at the k-th call of an extsrc function."""
    count = [0]
    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(EXTSRC):
            count[0] += 1
            if count[0] == k:
                sys.settrace(None)
                raise KeyboardInterrupt("in close()")
        return None
    return trace

def fds():
    return sorted(os.listdir("/proc/self/fd"))

def run(report):
    before_fds, before_threads = len(fds()), _thread._count()
    pids, interrupted = [], 0
    for k in range(1, 40):
        src = ParallelSource(Slow(), 4, num_workers=2, concurrency=8, prefetch=2, timeout=60)
        it = iter(src)
        next(it)
        pids += src.worker_pids()
        report.pids(pids)
        sys.settrace(interrupt_at_call(k))
        try:
            src.close()
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            sys.settrace(None)
        src.close()  # finishes what the interrupted one left
        del it, src
        assert _thread._count() == before_threads, (k, _thread._count(), threading.enumerate())
        assert len(fds()) == before_fds, (k, before_fds, fds())
    assert interrupted > 5, interrupted  # the interrupts landed inside close()
'''


def test_a_close_interrupted_anywhere_is_finished_by_the_next_close():
    result = run_fault(INTERRUPTED_CLOSES, timeout=120)
    assert result.type is None, result.traceback or result.stderr[-3000:]
    assert result.leftover_pids == [], f"workers outlived their source: {result.leftover_pids}"
    assert result.new_shm == []
