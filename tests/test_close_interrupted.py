"""A close() cut short by a KeyboardInterrupt (Ctrl-C at any line of it) is finished by the next
close(): workers, the I/O thread and descriptors are gone after it. (Before, the second close()
returned at once and left them all until the interpreter's exit.) The same for a source that is
dropped and whose close() from the garbage collector an interrupt cuts short. Each runs in its own
interpreter."""

import pytest

from faultkit import run_fault

_PRELUDE = '''
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

def iterated(pids, report):
    """A source with tasks in flight, and its loop after one batch; its workers recorded."""
    src = ParallelSource(Slow(), 4, num_workers=2, concurrency=8, prefetch=2, timeout=60)
    it = iter(src)
    next(it)
    pids += src.worker_pids()
    report.pids(pids)
    return src, it
'''

INTERRUPTED_CLOSES = _PRELUDE + '''
def run(report):
    before_fds, before_threads = len(fds()), _thread._count()
    pids, interrupted = [], 0
    for k in range(1, 40):
        src, it = iterated(pids, report)
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


@pytest.mark.slow
def test_a_close_interrupted_anywhere_is_finished_by_the_next_close():
    result = run_fault(INTERRUPTED_CLOSES, timeout=120)
    assert result.type is None, result.traceback or result.stderr[-3000:]
    assert result.leftover_pids == [], f"workers outlived their source: {result.leftover_pids}"
    assert result.new_shm == []


# Nobody calls close(): the source is dropped, and the close() its collection makes is cut short.
# Python drops an exception raised in __del__ ("Exception ignored in"): the close is finished
# there, or (cut short before its first step) by the pool's I/O thread once the source is gone.
INTERRUPTED_COLLECTIONS = _PRELUDE + '''
import gc, time

def until(condition, what, limit_s=60.0):  # a hang fails; a slow machine only waits longer
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        gc.collect()  # as the collector runs in any program: the loop's epoch and its source refer to each other
        time.sleep(0.01)

def run(report):
    before_fds, before_threads = len(fds()), _thread._count()
    pids, interrupted = [], 0
    for k in range(1, 40):
        src, it = iterated(pids, report)
        sys.settrace(interrupt_at_call(k))
        try:
            del it, src  # the source's __del__ closes it
        finally:
            interrupted += sys.gettrace() is None  # the trace took itself off: it raised
            sys.settrace(None)
        until(lambda: _thread._count() == before_threads and len(fds()) == before_fds,
              f"threads or descriptors left after a close cut short at call {k}")
    assert interrupted > 5, interrupted  # the interrupts landed inside the collection's close()
'''


@pytest.mark.slow
def test_a_close_from_the_garbage_collector_that_an_interrupt_cut_short_is_finished_there():
    result = run_fault(INTERRUPTED_COLLECTIONS, timeout=120)
    assert result.type is None, result.traceback or result.stderr[-3000:]
    assert result.leftover_pids == [], f"workers outlived their source: {result.leftover_pids}"
    assert result.new_shm == []
