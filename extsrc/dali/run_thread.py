"""DALI's ``run()`` and ``reset()`` on a thread of their own, so that no interrupt splits them.

A ``KeyboardInterrupt`` (Ctrl-C, or any signal handler's exception) is raised
in the main thread at almost any point of Python code. Inside DALI's
``Pipeline.run()`` that loses data: DALI counts an iteration before it feeds
it, and ``Outputs()`` pops DALI's output queue before the outputs reach the
caller, so an interrupt in between drops a batch or shifts the epoch. DALI's
frames are DALI's; what the drop-in can do is keep the interrupt out of them.

:class:`RunThread` runs each call in one thread that is not the main thread
(Python runs signal handlers in the main thread only), while the caller waits
for the outcome. An interrupt reaches the caller at once, in the wait; the
call goes on and its outcome (outputs, or the exception DALI raised,
``StopIteration`` included) is kept as the *pending call*, handed over by the
next call of the same kind: exactly once, whatever interrupts which line.

The steps, in the caller's thread:

1. **Start**: one store makes the call pending (:meth:`RunThread.start`);
   from then on the thread runs it, whether or not the caller is still there.
2. **Wait**: until the call is done (its outcome stored, then ``done`` set).
   Waiting consumes nothing, so an interrupt here leaves the call pending.
3. **Hand over**: the call is swapped out of ``pending`` and its outcome
   returned or raised, with no call in between (see :mod:`extsrc.engine.take`
   for why that cannot be split).

Threads: one consumer thread at a time (as DALI's ``run()``). Between calls
the run thread holds neither the pipeline nor its :class:`RunThread`; it ends
at :meth:`RunThread.stop`, or once nothing references its ``RunThread`` (a
pipeline dropped after an interrupt cut its ``close()`` short, a constructor
interrupted after the start): no thread outlives its owner.
"""

from __future__ import annotations

import _thread
import functools
import os
import threading
import weakref
from typing import Any, Callable, Optional

from extsrc.engine import OwnedThread

# How long each side waits on its wake-up lock before it looks at the state again. The lock
# normally ends the wait at once; the poll only bounds it when an interrupt made the caller
# take a wake-up it then did not act on.
POLL_S = 0.05

RUN = "run"
RESET = "reset"


class Call:
    """One call made on the run thread: what to run, then its outcome.

    ``done`` is stored last, after ``value`` or ``error``; the caller reads
    the outcome only once ``done`` is true.
    """

    __slots__ = ("kind", "fn", "value", "error", "done", "caller")

    def __init__(self, kind: str, fn: Callable[[], Any]):
        self.kind = kind
        self.caller = threading.get_ident()  # the thread its outcome is handed to
        self.fn: Optional[Callable[[], Any]] = fn
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.done = False


class RunThread:
    """Runs one call at a time on a daemon thread for a consumer thread (see the module doc)."""

    def __init__(self, name: str):
        self.name = name
        self.pending: Optional[Call] = None  # started and not handed over yet
        self._wake = _thread.allocate_lock()  # released by the caller: a call was started
        self._wake.acquire()
        self._finished = _thread.allocate_lock()  # released by the thread: a call is done
        self._finished.acquire()
        self._stopping = False
        # Started here, not on first use: a thread started in the middle of an interruptible
        # call could be started twice, or be stored and never run.
        self._pid = os.getpid()
        self._thread = self._start_thread()

    def _start_thread(self) -> OwnedThread:
        # The thread holds this object only by a weak reference: one that nobody else holds
        # (a constructor cut short by an interrupt after the start, or a pipeline dropped
        # while an interrupt cut its close() short, before stop()) ends the thread.
        thread = OwnedThread(functools.partial(RunThread._loop, weakref.ref(self), self._wake),
                             self.name)
        thread.start()
        return thread

    # -- caller's thread -----------------------------------------------------------------------

    def start(self, kind: str, fn: Callable[[], Any]) -> None:
        """Makes ``fn`` the pending call (step 1) and wakes the thread. Nothing may be pending."""
        if self.pending is not None:
            raise RuntimeError(f"{self.name}: a {self.pending.kind}() call is still pending")
        if self._pid != os.getpid():  # a forked child: the parent's thread is not here
            # The pid is stored last: an interrupt before it makes the next call start a thread
            # again (a thread started and not stored serves calls too, and ends with this object).
            self._thread = self._start_thread()
            self._pid = os.getpid()
        self.pending = Call(kind, fn)  # the commit point: the thread runs it from here on
        if self._wake.locked():
            self._wake.release()

    def wait(self) -> None:
        """Waits until the pending call (if any) is done (step 2); hands nothing over. Returns at
        once on the run thread itself (the call waited for would be the one running there)."""
        if self._thread.is_current():
            return
        call = self.pending
        while call is not None and not call.done:
            self._finished.acquire(timeout=POLL_S)
            if not call.done and (self._pid != os.getpid() or self._thread.ended):
                # A child forked while the call ran has no run thread: nothing will finish it.
                self.pending = None
                raise RuntimeError(f"{self.name}: the {call.kind}() call cannot finish here: the "
                                   "thread running it is gone (a process forked while it ran)")

    def collect(self) -> Any:
        """Waits for the pending call and hands its outcome over: returns its value or raises its
        exception (steps 2 and 3). Exactly once per call, whatever interrupts the caller; only
        to the thread that started it (``RuntimeError`` in any other)."""
        seen = self.pending
        self.wait()
        call = self.pending
        if call is None and seen is not None and seen.caller != threading.get_ident():
            call = seen  # another thread's call, handed to it while this one waited: refused below
        assert call is not None, "collect() without a call"
        if call.caller != threading.get_ident():
            # Another thread's call (two threads in run() at once): it stays pending for the
            # thread that started it, which would otherwise find nothing to hand over.
            raise RuntimeError(
                f"{self.name}: a {call.kind}() call of thread {call.caller} is in progress and "
                f"thread {threading.get_ident()} called too; use a pipeline from one thread at a "
                "time (as DALI's), e.g. under a lock of yours")
        self.pending = None
        error, call.error = call.error, None
        if error is not None:
            try:
                raise error
            finally:
                # No cycle (error -> traceback -> this frame -> error) keeping the pipeline
                # alive until the garbage collector runs: DALI's frames in it reference it.
                error = call = None
        return call.value

    def drop(self) -> None:
        """Forgets the pending call's outcome (it must be done: :meth:`wait` first)."""
        self.pending = None

    def stop(self) -> None:
        """Waits for a call in progress, then ends the thread. Idempotent."""
        self.wait()
        self._stopping = True
        if self._wake.locked():
            self._wake.release()
        if self._pid == os.getpid():
            self._thread.join()

    # -- the run thread ------------------------------------------------------------------------

    @staticmethod
    def _loop(owner: "weakref.ReferenceType[RunThread]", wake: Any) -> None:
        # Between calls the thread holds neither its RunThread nor the pipeline: it ends within
        # POLL_S of the last reference to its RunThread going (or of stop()).
        while True:
            wake.acquire(timeout=POLL_S)
            runner = owner()
            if runner is None or runner._stopping:
                return
            call = runner.pending
            if call is None or call.fn is None:
                del runner, call
                continue
            fn, call.fn = call.fn, None  # the pipeline is referenced only while the call runs
            try:
                call.value = fn()
            except BaseException as exc:  # handed to the caller, whatever it is
                call.error = exc
            del fn
            call.done = True
            if runner._finished.locked():
                runner._finished.release()
            del runner, call
