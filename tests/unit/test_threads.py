"""Threads extsrc owns stay seen as running when the thread that waits for them is interrupted.

An interrupt is raised here at the k-th line the waiting thread runs (in extsrc or in
the standard library under it), for every k over a few polls: the deterministic form of
a Ctrl-C landing anywhere in the wait.
"""

import sys
import threading

import pytest

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


@pytest.mark.slow
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


class _SecondWaitsLonger(RunThread):
    """A RunThread whose ``wait()`` in the thread ``late`` returns only once ``go`` is set:
    the order in which two threads in ``run()`` at once see a call finish, made certain."""

    late = None

    def __init__(self, name):
        super().__init__(name)
        self.entered, self.go = threading.Event(), threading.Event()

    def wait(self):
        if threading.current_thread() is not self.late:
            return super().wait()
        self.entered.set()
        super().wait()
        assert self.go.wait(10)


def test_a_second_thread_that_waited_on_another_threads_call_is_refused_after_it_was_handed_over():
    # Two threads in run() at once: B waits on A's call, A collects it first. B must hear that
    # two threads called, and A must get its call's outcome exactly once.
    runner = _SecondWaitsLonger("extsrc-test-run")
    gate, second = threading.Event(), []

    def thread_b():
        try:
            second.append(runner.collect())
        except BaseException as exc:  # what B is told, asserted below
            second.append(exc)

    runner.late = threading.Thread(target=thread_b)
    try:
        runner.start("run", lambda: gate.wait() and "A's batch")
        runner.late.start()
        assert runner.entered.wait(10)  # B has seen A's call and waits for it
        gate.set()
        assert runner.collect() == "A's batch"
        runner.go.set()
        runner.late.join(10)
        assert len(second) == 1 and isinstance(second[0], RuntimeError), second
        assert "called too" in str(second[0]) and "one thread at a time" in str(second[0])
        assert runner.pending is None  # nothing left over for a later call
    finally:
        runner.go.set()
        runner.stop()



# Threads that die before their first line (no memory for their first frame under ulimit -v),
# stood for by a `_thread` whose start_new_thread makes no thread, or whose get_ident() raises
# in the new thread. Each case in its own interpreter with a time limit: a hang fails it.
_BEGIN_CASES = '''
import _thread, sys, time
from extsrc.engine import threads
from extsrc.engine.concurrent import ThreadEngine
from extsrc.engine.threads import OwnedThread
from script_helpers import until

MAIN = _thread.get_ident()


class Unstarted:
    """start_new_thread makes a thread that never runs; run_late() runs it after all."""
    def __init__(self):
        self.pending = []
    def __getattr__(self, name):
        return getattr(_thread, name)
    def start_new_thread(self, function, args):
        self.pending.append((function, args))
        return 1
    def run_late(self):
        function, args = self.pending.pop()
        _thread.start_new_thread(function, args)


class NoMemoryForIdent:
    """The new thread runs, and fails on its first allocation (its ident's int)."""
    def __getattr__(self, name):
        return getattr(_thread, name)
    def get_ident(self):
        if _thread.get_ident() != MAIN:
            raise MemoryError()
        return MAIN


threads.THREAD_BEGIN_S = 0.3
case = sys.argv[1] if len(sys.argv) > 1 else "{case}"
ran = []
if case == "never-begins":
    unstarted = threads._thread = Unstarted()
    thread = OwnedThread(lambda: ran.append(1), "never-begins")
    try:
        thread.start()
    except RuntimeError as exc:
        print("RAISED", "did not begin" in str(exc) and "never-begins" in str(exc))
    print("STARTED", thread.started, "JOINED", thread.join())
    try:
        thread.start()  # waited for ever before
    except RuntimeError as exc:
        print("AGAIN", "started already" in str(exc))
    threads._thread = _thread
    unstarted.run_late()  # scheduled after all, once start() gave up on it
    until(lambda: _thread._count() == 0, "the late thread never ended")
    print("TARGET RAN", ran)
elif case == "no-memory-after-first-line":
    threads._thread = NoMemoryForIdent()
    thread = OwnedThread(lambda: ran.append(1), "no-memory")
    thread.start()  # waited for ever before: the thread died before telling start()
    print("JOINED", thread.join(), "TARGET RAN", ran)
elif case == "interrupted-start":
    unstarted = threads._thread = Unstarted()
    engine = ThreadEngine(lambda x: x * 10, 1)
    def profile(frame, event, arg):  # lands as start()'s first wait for the thread returns
        if event == "c_return" and getattr(arg, "__name__", "") == "acquire" and frame.f_code.co_name == "_settle":
            sys.setprofile(None)
            raise KeyboardInterrupt
    sys.setprofile(profile)
    try:
        engine._ensure_threads()
    except KeyboardInterrupt:
        print("INTERRUPTED")
    finally:
        sys.setprofile(None)
    threads._thread = _thread  # memory is back
    engine._ensure_threads()  # the thread that never began is given up on and replaced
    got = []
    engine.run([(0, 1)], lambda position, value: got.append(value), None)
    print("RUN", got)
    engine.close()
'''


def _begin_case(case):
    from faultkit import run_isolated

    result = run_isolated(_BEGIN_CASES.replace("{case}", case), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    return result.stdout


def test_a_thread_that_never_begins_makes_start_raise_and_never_runs_its_target_later():
    out = _begin_case("never-begins")
    assert "RAISED True" in out, out  # start() returned before, as if the thread ran
    assert "STARTED False JOINED False" in out, out  # nothing to wait for
    assert "AGAIN True" in out, out  # a second start() is refused (it waited for ever)
    assert "TARGET RAN []" in out, out


def test_a_thread_that_dies_right_after_its_first_line_neither_hangs_start_nor_join():
    assert "JOINED True TARGET RAN []" in _begin_case("no-memory-after-first-line")


def test_an_interrupted_start_of_a_thread_that_never_begins_is_given_up_by_the_next_look():
    out = _begin_case("interrupted-start")
    assert "INTERRUPTED" in out and "RUN [10]" in out, out


# A DALI run() started in a process forked from one that used the pipeline: the parent's run
# thread is not there, and the first start() in the child makes one. An interrupt at each place
# one can land in that start(), then the call made again: it must run (a hang fails the child's
# time limit). Each child exits with 0 (the call ran) + 10 (the interrupt landed) + 20 (no place
# was left: the walk is over), or 1 for a wrong value.
_FORKED_START = '''
import os, time
import extsrc
from extsrc.dali.run_thread import RunThread
from interrupting import cut_at_landing

EXTSRC = os.path.dirname(extsrc.__file__)
CHILD_LIMIT_S = 20.0  # a call that runs takes milliseconds; one that never runs takes for ever

runner = RunThread("extsrc-test-run")
runner.start("run", lambda: "parent")
assert runner.collect() == "parent"
interrupted = hung = k = 0
while True:
    k += 1
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            cut, over = cut_at_landing(k, EXTSRC, lambda: runner.start("run", lambda: k))
            if runner.pending is None:  # cut before its commit: the caller calls again
                runner.start("run", lambda: k)
            code = (0 if runner.collect() == k else 1) + (10 if cut else 0) + (20 if over else 0)
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_LIMIT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = None
            break
        time.sleep(0.01)
    if status is None:
        hung += 1
        print("HUNG at landing", k)
        assert k < 1000, "the walk over the landings does not end"
        continue
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 10, 20, 30), (k, code)
    interrupted += code in (10, 30)
    if code >= 20:
        break
runner.stop()
print("INTERRUPTED", interrupted > 20, "HUNG", hung, "LANDINGS", k - 1)
'''


def test_a_dali_run_started_in_a_forked_child_runs_wherever_its_start_was_interrupted():
    from faultkit import run_isolated

    result = run_isolated(_FORKED_START, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "INTERRUPTED True HUNG 0" in result.stdout, result.stdout


def test_a_thread_defers_on_wake_up_and_back_and_no_other_thread_changes():
    import os

    import pytest

    from extsrc.engine.threads import defer_on_wake_up

    if not hasattr(os, "SCHED_BATCH"):
        pytest.skip("thread scheduling policies are Linux's")
    seen = []

    def body():
        seen.append((defer_on_wake_up(True), os.sched_getscheduler(0)))
        seen.append((defer_on_wake_up(True), os.sched_getscheduler(0)))  # again: no change
        seen.append((defer_on_wake_up(False), os.sched_getscheduler(0)))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [(True, os.SCHED_BATCH), (True, os.SCHED_BATCH), (False, os.SCHED_OTHER)]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


@pytest.mark.parametrize("policy", ["SCHED_BATCH", "SCHED_IDLE"])
def test_a_thread_the_user_put_under_another_policy_keeps_it(policy):
    # A program run under `chrt -b` or `chrt -i`: its threads, the pool's I/O thread among them,
    # inherit the policy, and deferring and back must leave it as the user chose.
    import os

    from extsrc.engine.threads import defer_on_wake_up

    if not hasattr(os, policy):
        pytest.skip("thread scheduling policies are Linux's")
    chosen = getattr(os, policy)
    seen = []

    def body():
        os.sched_setscheduler(0, chosen, os.sched_param(0))  # no privilege needed for these
        defer_on_wake_up(True)
        seen.append(os.sched_getscheduler(0))
        defer_on_wake_up(False)
        seen.append(os.sched_getscheduler(0))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [chosen, chosen]
