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

from typing import Callable, Optional

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
