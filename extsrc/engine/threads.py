"""Threads whose start and end can be waited for and checked from an interrupted thread.

Why not ``threading.Thread``: up to CPython 3.12 its ``start()``, ``is_alive()``
and ``join()`` run Python code that a ``KeyboardInterrupt`` can cut short
between two lock calls. ``is_alive()`` and ``join()`` then take a thread that
still runs for ended (the handler added for bpo-45274 releases a lock the
live thread still holds and marks the thread stopped), and extsrc would give
up on a call in progress or close a descriptor that thread still polls.
``start()`` waits for the new thread on an ``Event``; interrupted there, it
may leave the ``Event``'s lock taken (the new thread then blocks before its
target, for ever), or raise ``RuntimeError`` for a thread that was made and
runs its target (taken for "no thread could be made", the start was made a
second time). A storm of interrupts (see ``tests/test_interrupt_storm.py``)
hits all of them.

:class:`OwnedThread` is no ``threading.Thread``: :meth:`OwnedThread.start` is
one C call (``_thread.start_new_thread``), and the thread itself tells what
happened: it records its ident as its first step, sets ``ended`` as its last
and then releases a lock that :meth:`OwnedThread.join` waits on. ``started``
is set just before that C call, and set back only if the call raised: it is
true whenever the thread exists. ``start()`` returns once the thread runs its
first line: a thread can die before that line (its first frame needs memory,
which under ``ulimit -v`` may be gone; CPython then prints "Exception ignored in
thread started by" and tells nobody), and an owner that took such a thread for
running would wait for it for ever. An interrupt in ``join()`` leaves at worst
that lock taken, and ``ended`` answers every later call. Such a thread is not
in ``threading.enumerate()`` (``_thread._count()`` counts it), and
``threading.current_thread()`` in it is a dummy; ``name`` is for messages.
At interpreter exit it is a daemon thread.

Owner: the object that started the thread (in the thread that calls
``start``); any thread may call ``join`` and read ``started`` and ``ended``.
In a process forked while the thread ran, the thread is gone but ``ended``
is false: owners compare the pid they were made in.
"""

from __future__ import annotations

import _thread
import sys
from typing import Any, Callable, Optional

# start() waits this long for the new thread's first line before it takes the thread for dead
# (no memory for its first frame). A thread the OS made is scheduled within milliseconds even
# on a saturated machine; the wait ends as soon as it runs.
THREAD_BEGIN_S = 20.0


class OwnedThread:
    """A daemon thread running ``target()``; ``ended`` once ``target`` returned or raised.

    ``start()`` raises ``RuntimeError`` if no thread could be made (e.g. under an
    address-space limit), or the one made did not begin within :data:`THREAD_BEGIN_S`;
    ``target`` is then never called and ``started`` is false.
    Interrupted (``KeyboardInterrupt``), it raises with ``started`` true if the thread
    was made: the thread runs ``target`` all the same, and :meth:`join` waits for it.
    """

    __slots__ = ("name", "started", "ended", "_ident", "_target", "_done", "_began", "_claim")

    def __init__(self, target: Callable[[], Any], name: str):
        self.name = name
        self.started = False  # true from just before the C call that makes the thread
        self.ended = False
        self._ident: Optional[int] = None  # stored by the thread itself, first thing
        self._target: Optional[Callable[[], Any]] = target
        self._done = _thread.allocate_lock()  # held until target's end: join() waits on it
        self._done.acquire()
        self._began = _thread.allocate_lock()  # held until the thread runs: start() waits on it
        self._began.acquire()
        # Taken by the thread as it begins, or by a start() that gave up waiting for it: the
        # one that takes it decides whether target runs.
        self._claim = _thread.allocate_lock()

    def start(self) -> None:
        """Starts the thread (once)."""
        if self.started:
            raise RuntimeError(f"thread {self.name} was started already")
        # A plain store, then the C call: no interrupt lands between the two, so a thread
        # never exists with ``started`` false. An interrupt after the call is no Exception:
        # it leaves ``started`` true, as the thread runs.
        self.started = True
        try:
            _thread.start_new_thread(self._main, ())
        except Exception:  # raised by the call: no thread was made
            self.started = False
            raise
        if self._began.acquire(True, THREAD_BEGIN_S):
            return
        if not self._claim.acquire(False):  # it began just now, and releases _began next
            self._began.acquire()
            return
        # It never began, and now never runs target. (An interrupt landing before the next
        # line leaves ``started`` true: join() then waits for its timeout, as for a live thread.)
        self.started = False
        raise RuntimeError(f"thread {self.name} did not begin within {THREAD_BEGIN_S:.0f} s: it "
                           "had no memory for its first frame, or the process is stopped")

    @property
    def ident(self) -> Optional[int]:
        """The thread's ident once it runs, else ``None``."""
        return self._ident

    def is_current(self) -> bool:
        """Whether the caller is this thread."""
        return self._ident is not None and self._ident == _thread.get_ident()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Waits until ``target`` ended, at most ``timeout`` seconds (``None``: no limit); returns
        ``ended``. At once when the thread was never started, when called from itself, or while
        the interpreter shuts down."""
        if self.ended or not self.started or self.is_current() or sys.is_finalizing():
            # While the interpreter shuts down (an owner's __del__ at exit) daemon threads no
            # longer run: waiting for one would never end.
            return self.ended
        if self._done.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._done.release()
        return self.ended

    def _main(self) -> None:
        try:  # whatever fails here (a MemoryError, even before the target), ``ended`` is set
            if not self._claim.acquire(False):
                return  # start() gave up waiting for this thread: target is not run
            self._ident = _thread.get_ident()  # before the target: is_current() in it answers True
            self._began.release()
            target = self._target
            assert target is not None, f"thread {self.name} ran its target twice"
            target()
        finally:
            self._target = None  # what the target references is not kept by an ended thread
            self.ended = True  # before the release: a join() that woke reads True
            self._done.release()
