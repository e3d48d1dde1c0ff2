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
running would wait for it for ever. Whether ``target`` runs is decided once, by
whoever takes a claim lock first: the thread at its first line, or a
``start()``/``join()`` that gave up waiting for that line. What was decided is
read back from the claim and from plain flags the thread alone sets (begun;
runs; lost the claim), never from a local that an interrupt could have cut
short, so an interrupted ``start()`` is finished by ``join()``. The thread's
states, as seen by its owner::

    made ──first line, claim taken──► RUNS ──target returns/raises──► ended
     │
     └──no first line within THREAD_BEGIN_S (claim taken by start()/join())──► never runs
                                                       (``started`` set back to false)

An interrupt in ``join()`` leaves at worst
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
import math
import os
import sys
import time
from typing import Callable, Optional

# start() waits this long for the new thread's first line before it takes the thread for dead
# (no memory for its first frame). A thread the OS made is scheduled within milliseconds even
# on a saturated machine; the wait ends as soon as it runs.
THREAD_BEGIN_S = 20.0
# While the thread's fate is being decided (it reached its first line and tries the claim, or
# lost it), the waiting side looks again this often; the thread itself wakes it when it runs.
BEGIN_POLL_S = 0.05


class OwnedThread:
    """A daemon thread running ``target()``; ``ended`` once ``target`` returned or raised.

    ``start()`` raises ``RuntimeError`` if no thread could be made (e.g. under an
    address-space limit), or the one made did not begin within :data:`THREAD_BEGIN_S`;
    ``target`` is then never called and ``started`` is false.
    Interrupted (``KeyboardInterrupt``), it raises with ``started`` true if the thread
    was made: the thread runs ``target`` all the same, and :meth:`join` waits for it (or,
    should it never begin, gives it up as ``start()`` would have and sets ``started`` back
    to false).
    """

    __slots__ = ("name", "started", "ended", "_ident", "_target", "_done", "_began", "_claim",
                 "_begun", "_runs", "_lost", "_give_up_at")

    def __init__(self, target: Callable[[], object], name: str):
        self.name = name
        self.started = False  # true from just before the C call that makes the thread
        self.ended = False
        self._ident: Optional[int] = None  # stored by the thread itself, first thing
        self._target: Optional[Callable[[], object]] = target
        self._done = _thread.allocate_lock()  # held until target's end: join() waits on it
        self._done.acquire()
        self._began = _thread.allocate_lock()  # held until the thread runs: start() waits on it
        self._began.acquire()
        # Taken by the thread at its first line, or by a start()/join() that gave up waiting
        # for that line: the one that takes it decides whether target runs.
        self._claim = _thread.allocate_lock()
        # Set by the thread alone, in this order, with plain stores (nothing to allocate):
        self._begun = False  # it reached its first line (and then tries the claim)
        self._runs = False  # it took the claim: target runs
        self._lost = False  # the claim was taken already: target never runs
        self._give_up_at = math.inf  # when a thread that has not begun is given up on

    def start(self) -> None:
        """Starts the thread (once); returns once it runs its first line."""
        if self.started or self._claim.locked():
            raise RuntimeError(f"thread {self.name} was started already")
        self._give_up_at = time.monotonic() + THREAD_BEGIN_S
        # A plain store, then the C call: no interrupt lands between the two, so a thread
        # never exists with ``started`` false. An interrupt after the call is no Exception:
        # it leaves ``started`` true, and join() finishes what this call would have.
        self.started = True
        try:
            _thread.start_new_thread(self._main, ())
        except Exception:  # raised by the call: no thread was made
            self.started = False
            raise
        if self._settle(math.inf):
            return
        raise RuntimeError(f"thread {self.name} did not begin within {THREAD_BEGIN_S:.0f} s: it "
                           "had no memory for its first frame, or the process was stopped")

    def begun(self) -> bool:
        """Whether the thread runs (or ran) ``target``: after a ``start()`` that an interrupt cut
        short, waits (at most until :data:`THREAD_BEGIN_S` after the start) for the thread's
        first line, and gives it up if it never came (``started`` is then set back to false).
        At once for a thread that returned from ``start()``."""
        return self.started and bool(self._settle(math.inf))

    def _never_runs(self) -> bool:
        # The claim is taken, not by the thread: it had not begun (it tries the claim only
        # after setting _begun), or it found the claim taken.
        return self._claim.locked() and not self._runs and (not self._begun or self._lost)

    def _settle(self, until: float) -> Optional[bool]:
        """Waits until the thread runs ``target`` (True) or never will (False: ``started`` is
        set back to false); ``None`` when ``until`` (``time.monotonic()``) passed first. Past
        ``_give_up_at`` a thread that has not begun is given up on. Safe to call again after an
        interrupt."""
        while True:
            if self._runs:
                return True
            if self._never_runs():
                self.started = False
                return False
            now = time.monotonic()
            if now >= self._give_up_at and not self._begun:
                self._claim.acquire(False)  # who got it is read back above
                continue
            if now >= until:
                return None
            wait = min(until, self._give_up_at) - now if not self._begun else BEGIN_POLL_S
            self._began.acquire(True, max(0.0, min(wait, THREAD_BEGIN_S)))

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
        deadline = math.inf if timeout is None else time.monotonic() + max(0.0, timeout)
        if not self._settle(deadline):  # after an interrupted start(): did the thread begin?
            return self.ended
        left = -1 if timeout is None else max(0.0, deadline - time.monotonic())
        if self._done.acquire(timeout=left):
            self._done.release()
        return self.ended

    def _main(self) -> None:
        # Up to the release of _began nothing allocates: no MemoryError can leave start() or
        # join() waiting for a decision.
        self._begun = True
        if not self._claim.acquire(False):
            self._lost = True
            return  # start() or join() gave up waiting for this thread: target is not run
        self._runs = True
        self._began.release()
        try:  # whatever fails here (a MemoryError, even before the target), ``ended`` is set
            self._ident = _thread.get_ident()  # before the target: is_current() in it answers True
            target = self._target
            assert target is not None, f"thread {self.name} ran its target twice"
            target()
        finally:
            self._target = None  # what the target references is not kept by an ended thread
            self.ended = True  # before the release: a join() that woke reads True
            self._done.release()


def defer_on_wake_up(defer: bool) -> bool:
    """Makes the calling thread defer to running threads when it wakes up (``defer``), or
    preempt them again (not ``defer``); returns whether it defers now. Linux only, through
    ``SCHED_BATCH``: the thread keeps its share of the CPU (same weight), but a wake-up waits
    for a free CPU or the end of the running thread's time slice instead of cutting that
    slice short.

    For the pool's I/O thread while the workers' tasks are short: woken by every answer, it
    preempted a worker each time (two context switches, the worker's caches cooled) to
    handle one answer; deferring, it handles the answers of a time slice together, and the
    workers hold enough tasks to run meanwhile (see :data:`extsrc.engine.policy.QUEUE_COVER_S`).
    With long tasks it preempts: wake-ups are then rare, and a batch is handed on at once.
    Only a thread whose own policy (the one it had at its first call) is the default one is
    switched, and only between that and ``SCHED_BATCH``: a thread the user put under
    another policy (``chrt -b``, ``chrt -i``, a real-time one) keeps it (as ``SCHED_BATCH`` a
    real-time thread would starve behind its own workers). Without the call (other
    systems), or refused (a sandbox), nothing changes."""
    if not hasattr(os, "sched_setscheduler") or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        policy = os.sched_getscheduler(0)  # 0: the calling thread
    except OSError:
        return False
    own = getattr(_own_policy, "policy", None)
    if own is None:
        own = _own_policy.policy = policy
    wanted = os.SCHED_BATCH if defer else os.SCHED_OTHER
    if own == os.SCHED_OTHER and policy != wanted and policy in (os.SCHED_OTHER, os.SCHED_BATCH):
        try:
            os.sched_setscheduler(0, wanted, os.sched_param(0))
        except OSError:
            return policy == os.SCHED_BATCH
        policy = wanted
    return policy == os.SCHED_BATCH


# The policy each thread had at its first defer_on_wake_up(): the one it goes back to.
_own_policy = _thread._local()
