"""A Ctrl-C at any place it can land while a source starts leaves nothing behind.

A KeyboardInterrupt is raised at the k-th such place in extsrc's code of the consumer's thread
(the start of each function, the return of each C call: where CPython runs a pending signal's
handler), for every other k (forkserver starts are slow). After each interrupted start the
source must start again and give its whole epoch, and after ``close()`` the process must have
the descriptors, threads and child processes it had before. Each case runs in its own
interpreter with a time limit (a hang fails the test).
"""

import pytest

from faultkit import run_isolated

WALK = '''
import _thread, os, sys
# Before extsrc's own fork hooks: a forked worker must not inherit the profile function.
os.register_at_fork(after_in_child=lambda: sys.setprofile(None))
import extsrc
from interrupting import interrupt_at_landing
from script_helpers import eight, epoch, until

METHOD, STRIDE = "forkserver", 2
EXTSRC = os.path.dirname(extsrc.__file__)


def descriptors():
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            pass
    return found


def children():
    found = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                found += f.read().split()
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(found)


def held():
    return descriptors(), _thread._count(), children()


if __name__ == "__main__":
    warm = extsrc.ParallelSource(eight, 2, num_workers=1, start_method=METHOD)
    assert epoch(warm) == list(range(8))  # the fork server or resource tracker runs from here
    warm.close()
    before = held()
    k, interrupted = 0, 0
    while True:
        k += STRIDE
        landings = [0]
        src = extsrc.ParallelSource(eight, 2, num_workers=2, start_method=METHOD)
        sys.setprofile(interrupt_at_landing(k, landings, EXTSRC))
        try:
            iter(src)
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            sys.setprofile(None)
        assert epoch(src) == list(range(8)), k
        src.close()
        del src
        until(lambda: held() == before, f"left after an interrupt at landing {k}: {held()} "
              f"against {before}")
        if landings[0] < k:
            break
    print("interrupted", interrupted, "of", k - STRIDE, "landings")
'''


WAKER_WALK = '''
import gc, os, sys
from extsrc.engine import workers
from interrupting import interrupt_at_landing

def descriptors():
    return sorted(os.listdir("/proc/self/fd"))

if __name__ == "__main__":
    before = descriptors()
    k = 0
    while True:
        k += 1
        landings, waker = [0], None
        sys.setprofile(interrupt_at_landing(k, landings, workers.__file__))
        try:
            waker = workers.Waker()
            waker.close()
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        if waker is not None:
            waker.close()  # finishes a close() the interrupt cut short
        del waker
        gc.collect()
        assert descriptors() == before, (k, descriptors(), before)
        if landings[0] < k:
            break
    print("interrupted at", k - 1, "landings")
'''


def test_an_interrupt_anywhere_in_making_or_closing_the_wake_up_pipe_leaves_no_descriptor():
    # The pool's wake-up pipe was two bare descriptor numbers (os.pipe2): an interrupt right
    # after the call, or between the two closes, left one open for good.
    result = run_isolated(WAKER_WALK, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    words = result.stdout.split()
    assert int(words[words.index("at") + 1]) >= 10, result.stdout


# Forkserver workers start on a thread of extsrc's, where no interrupt lands; fork and spawn
# workers start in the consumer's thread, where an interrupt right after multiprocessing forked
# or spawned one and before it was recorded still leaves it behind (see the README).
@pytest.mark.slow
def test_an_interrupt_anywhere_in_a_forkserver_start_leaves_nothing_after_close():
    result = run_isolated(WALK, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    words = result.stdout.split()
    assert int(words[words.index("interrupted") + 1]) >= 25, result.stdout


HOOK_WALK = '''
import os, signal, sys, threading
# Before logging's fork hooks: a forked worker must not inherit the profile function.
os.register_at_fork(after_in_child=lambda: sys.setprofile(None))
import logging
import extsrc
from interrupting import interrupt_at_landing
from script_helpers import eight, epoch


def logging_usable():
    """Whether another thread can take logging's lock (getLogger takes it)."""
    probe = threading.Thread(target=logging.getLogger, args=("probe",), daemon=True)
    probe.start()
    probe.join(10)
    return not probe.is_alive()


if __name__ == "__main__":
    k, raised = 0, 0
    while True:
        k += 1
        landings = [0]
        src = extsrc.ParallelSource(eight, 2, pool=extsrc.PoolSpec(
            num_workers=2, start_method="fork", worker_restarts=1))
        sys.setprofile(interrupt_at_landing(k, landings, logging.__file__))
        try:
            src.start()
        except KeyboardInterrupt:
            raised += 1
        finally:
            sys.setprofile(None)
        over = landings[0] < k
        assert over or raised == k, f"the interrupt at landing {k} in logging was lost"
        assert logging_usable(), f"logging's lock was left held after landing {k}"
        os.kill(src.worker_pids()[0], signal.SIGKILL)  # replaced from the pool's I/O thread
        assert epoch(src) == list(range(8)), k
        src.close()
        if over:
            break
    print("raised", raised, "of", k - 1, "landings")
'''


def test_an_interrupt_in_loggings_fork_hooks_is_raised_and_leaves_logging_usable():
    # logging takes its lock before a fork and gives it back after it in Python hooks, whose
    # exceptions Python prints and drops: a Ctrl-C landing there during a fork start was lost,
    # and logging's lock stayed held, so that the replacement of the next lost worker, forked
    # from the pool's I/O thread, waited for it forever (and close() with it).
    result = run_isolated(HOOK_WALK, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    words = result.stdout.split()
    assert int(words[words.index("raised") + 1]) >= 4, result.stdout
