"""Threads extsrc owns stay seen as running when the thread that waits for them is interrupted.

An interrupt is raised here at the k-th line the waiting thread runs (in extsrc or in
the standard library under it), for every k over a few polls: the deterministic form of
a Ctrl-C landing anywhere in the wait.
"""

import sys
import threading
import time

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


class _Unstarted:
    """Stands for ``_thread`` whose new thread dies before its first line (no memory for its
    first frame): the thread is made, its function is not run. ``run_late()`` runs it after all."""

    def __init__(self, real):
        self._real = real
        self.pending = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def start_new_thread(self, function, args):
        self.pending.append((function, args))
        return 1

    def run_late(self):
        function, args = self.pending.pop()
        self._real.start_new_thread(function, args)


def test_a_thread_that_never_begins_makes_start_raise_and_never_runs_its_target_later(monkeypatch):
    import _thread

    from extsrc.engine import threads

    unstarted = _Unstarted(_thread)
    monkeypatch.setattr(threads, "_thread", unstarted)
    monkeypatch.setattr(threads, "THREAD_BEGIN_S", 0.2)
    ran = []
    thread = OwnedThread(lambda: ran.append(1), "never-begins")
    try:
        thread.start()
    except RuntimeError as exc:
        assert "did not begin" in str(exc) and "never-begins" in str(exc), exc
    else:
        raise AssertionError("start() took a thread that never ran for started")
    assert not thread.started and not thread.join()  # nothing to wait for
    # Scheduled after all, once start() gave up on it: it must not run the target.
    monkeypatch.setattr(threads, "_thread", _thread)
    unstarted.run_late()
    deadline = time.monotonic() + 60  # a hang guard, not a timing assumption
    while not thread.ended:  # set by the late thread as it returns
        assert time.monotonic() < deadline, "the late thread never ended"
        time.sleep(0.01)
    assert ran == []  # it returned without running the target
