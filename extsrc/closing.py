"""Closing from ``__del__``: a close that an interrupt cut short is finished there.

The garbage collector runs ``__del__`` wherever the last reference goes, in
the middle of the user's code, so a Ctrl-C can land inside the ``close()``
it makes. Python prints an exception raised there ("Exception ignored in")
and drops it; the close stayed half done (workers, threads, descriptors left
until the interpreter exits). Every ``close()`` in extsrc resumes where an
interrupted one stopped, so :func:`close_when_collected` calls it again until
it returns, and only then lets the interrupt go its way (printed and dropped,
as Python does with any exception of ``__del__``). An interrupt at the first
line of ``__del__``, before any of this, leaves the close to the pool's I/O
thread: once every source of a pool is collected, it stops the workers
(see :mod:`extsrc.engine.pool`).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable, Optional, Union

# A close() that interrupts keep cutting short is called again at most this many times (each call
# resumes where the last stopped, so one more is enough unless a storm of signals goes on); the
# object is then left as it stands, as without this module.
CLOSE_TRIES = 100


def close_when_collected(close: Callable[[], None]) -> None:
    """For ``__del__``: calls ``close()`` until it returns, then raises the last
    ``KeyboardInterrupt`` that cut a call short, if any (Python prints it, as it
    would have without this function). Any other exception ends the close
    silently: at interpreter exit the modules it needs may be gone already.
    """
    interrupt: Optional[KeyboardInterrupt] = None
    try:
        for _ in range(CLOSE_TRIES):
            try:
                close()
                break
            except KeyboardInterrupt as exc:
                interrupt = exc
            except Exception:
                break
        if interrupt is not None:
            raise interrupt
    finally:
        interrupt = None  # no cycle through the traceback's frames


def close_at_exit(close: Callable[[], None]) -> None:
    """For ``atexit``: calls ``close()`` to its end, whatever Ctrl-C the user presses meanwhile.

    At exit the program is over: a Ctrl-C landing in the close would stop it half-way and print a
    traceback, leaving the workers to the kernel's parent-death signal (they die a moment after
    the program instead of being reaped by it). So SIGINT goes to a handler that does nothing
    until the close returns (it is bounded: the I/O thread's join and the workers' stop graces),
    then the program's own handler is back. An interrupt already on its way when the handler
    changed cuts one call short, and the close is called again (it resumes), as
    :func:`close_when_collected` does; the interrupt is then dropped, as any other exception.
    """
    previous = _hold_sigint()
    try:
        close_when_collected(close)
    except KeyboardInterrupt:
        pass  # the program is ending anyway: no traceback for a Ctrl-C that came before the hold
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers]


def _hold_sigint() -> Optional[_Handler]:
    """Puts a handler that does nothing on SIGINT; returns the one to put back, or None where
    the handler cannot change (not the main thread) or was not set from Python."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        previous = signal.signal(signal.SIGINT, _no_interrupt)
    except (ValueError, OSError):
        return None
    return previous if previous is not None else signal.SIG_DFL


def _no_interrupt(signum: int, frame: Optional[FrameType]) -> None:
    return None


class ClosedWhenCollected:
    """A base for objects that close themselves when collected: its ``__del__`` calls
    :func:`close_when_collected` with the object's ``close``. The function is bound when the
    class is made, not looked up when ``__del__`` runs: at interpreter exit the modules' names
    are set to None before the last objects go ("'NoneType' object is not callable")."""

    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError

    def __del__(self, _collected: Callable[[Callable[[], None]], None] = close_when_collected) -> None:
        _collected(self.close)
