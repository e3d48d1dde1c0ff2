"""Threads extsrc owns stay seen as running when the thread that waits for them is interrupted.

An interrupt is raised here at the k-th line the waiting thread runs (in extsrc or in
the standard library under it), for every k over a few polls: the deterministic form of
a Ctrl-C landing anywhere in the wait.
"""

import sys
import threading

from extsrc.dali.run_thread import RunThread
from extsrc.engine.threads import OwnedThread

LINES = 60  # more than a few rounds of each wait's polling loop


def interrupted_at_line(k, fn):
    """Calls ``fn()``, raising KeyboardInterrupt at the k-th line event under it; True if raised."""
    count = [0]

    def trace(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] == k:
                sys.settrace(None)
                raise KeyboardInterrupt(f"line {k}")
        return trace

    sys.settrace(trace)
    try:
        fn()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def test_an_interrupted_join_neither_ends_the_thread_nor_stops_a_later_join_from_waiting():
    for k in range(1, LINES):
        gate = threading.Event()
        thread = OwnedThread(gate.wait, "waits")
        thread.start()
        # Each short join runs a few lines: LINES of them run past the k-th line for every k.
        assert interrupted_at_line(k, lambda t=thread: [t.join(0.001) for _ in range(LINES)]), k
        assert not thread.ended, k
        assert not thread.join(0.01), k
        gate.set()
        assert thread.join(), k
        assert thread.ended


def test_a_dali_run_call_is_handed_over_once_after_its_wait_was_interrupted_at_any_line():
    runner = RunThread("extsrc-test-run")
    try:
        for k in range(1, LINES):
            gate = threading.Event()
            runner.start("run", lambda g=gate, k=k: g.wait() and k)
            assert interrupted_at_line(k, runner.collect), k
            gate.set()
            assert runner.collect() == k  # with DALI's pipeline, a batch neither lost nor repeated
            assert runner.pending is None
    finally:
        runner.stop()


def test_join_from_the_thread_itself_returns_at_once():
    seen = []
    thread = OwnedThread(lambda: seen.append(thread.join()), "joins-itself")
    thread.start()
    assert thread.join()
    assert seen == [False]  # not ended while its target runs
