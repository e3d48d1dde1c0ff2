"""Threads whose end can be waited for and checked from an interrupted thread.

Why not ``Thread.is_alive()`` and ``Thread.join()``: up to CPython 3.12 both run
Python code that, when a ``KeyboardInterrupt`` lands between its lock calls,
takes the thread for ended (the handler added for bpo-45274 releases a lock the
live thread still holds and marks the thread stopped). From then on
``is_alive()`` is ``False`` for a thread that is still running, and extsrc
would give up on a call in progress or close a descriptor that thread still
polls. A storm of interrupts (see ``tests/test_interrupt_storm.py``) hits it.

:class:`OwnedThread` asks the thread itself: its target sets ``ended`` as its
last step and then releases a lock that :meth:`OwnedThread.join` waits on. An
interrupt in ``join()`` leaves at worst that lock taken, and ``ended`` answers
every later call.

Owner: the object that started the thread; any thread may call ``join`` and read
``ended``. In a process forked while the thread ran, the thread is gone but
``ended`` is false: owners compare the pid they were made in.
"""

from __future__ import annotations

import _thread
import sys
import threading
from typing import Any, Callable, Optional


class OwnedThread:
    """A daemon thread running ``target()``; ``ended`` once ``target`` returned or raised.

    ``start()`` raises ``RuntimeError`` if no thread could be made (e.g. under an
    address-space limit); ``target`` is then never called.
    """

    __slots__ = ("name", "ended", "_target", "_done", "_thread")

    def __init__(self, target: Callable[[], Any], name: str):
        self.name = name
        self.ended = False
        self._target: Optional[Callable[[], Any]] = target
        self._done = _thread.allocate_lock()  # held until target's end: join() waits on it
        self._done.acquire()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Starts the thread (once)."""
        if self._thread is not None:
            raise RuntimeError(f"thread {self.name} was started already")
        thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        thread.start()
        self._thread = thread

    @property
    def ident(self) -> Optional[int]:
        """The thread's ident once it runs, else ``None``."""
        return None if self._thread is None else self._thread.ident

    def is_current(self) -> bool:
        """Whether the caller is this thread."""
        return self._thread is not None and self._thread.ident == threading.get_ident()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Waits until ``target`` ended, at most ``timeout`` seconds (``None``: no limit); returns
        ``ended``. At once when the thread was never started, when called from itself, or while
        the interpreter shuts down."""
        if self.ended or self._thread is None or self.is_current() or sys.is_finalizing():
            # While the interpreter shuts down (an owner's __del__ at exit) daemon threads no
            # longer run: waiting for one would never end.
            return self.ended
        if self._done.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._done.release()
        return self.ended

    def _main(self) -> None:
        target = self._target
        assert target is not None, f"thread {self.name} ran its target twice"
        try:
            target()
        finally:
            self._target = None  # what the target references is not kept by an ended thread
            self.ended = True  # before the release: a join() that woke reads True
            self._done.release()
