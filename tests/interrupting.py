"""Interrupts placed where a Ctrl-C can land, for scripts that walk every such place in turn.

CPython runs signal handlers at the start of a Python function (among other places), so a
``KeyboardInterrupt`` raised by a trace function at a ``call`` event lands exactly where a real
Ctrl-C could. Counting calls, not lines: a line event also fires where no signal can land
(before a with-statement's exit, for one).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Tuple, Union


def interrupt_at_call(k: int, calls: List[int], watched: Union[str, Tuple[str, ...]],
                      returns: bool = False) -> Callable[[Any, str, Any], Any]:
    """A trace function (``sys.settrace``) that counts in ``calls[0]`` the calls of Python
    functions whose file starts with ``watched`` (a folder or file, or several), and their
    returns as well with ``returns``, and raises ``KeyboardInterrupt`` at the ``k``-th. A
    script raises it at every such event in turn by trying k = 1, 2, ... until
    ``calls[0] < k`` after the traced step (no event was left)."""
    counted = ("call", "return") if returns else ("call",)

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(watched):
            return None
        if event in counted:
            calls[0] += 1
            if calls[0] == k:
                raise KeyboardInterrupt(f"at event {k}")  # also ends the tracing
        return trace if returns else None  # a return event needs the frame traced

    return trace


def interrupt_at_landing(k: int, landings: List[int],
                         watched: Union[str, Tuple[str, ...]]) -> Callable[[Any, str, Any], Any]:
    """A profile function (``sys.setprofile``) that counts in ``landings[0]`` the places where a
    Ctrl-C can land in code whose file starts with ``watched``: the start of each of its Python
    functions, and the return of each C function it calls (CPython looks for a pending signal
    right after a call returns); it raises ``KeyboardInterrupt`` at the ``k``-th. Finer than
    :func:`interrupt_at_call`: between two C calls of one line too (``os.close(a); os.close(b)``).
    Walk k = 1, 2, ... until ``landings[0] < k`` after the profiled step."""

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "c_return") or not frame.f_code.co_filename.startswith(watched):
            return
        landings[0] += 1
        if landings[0] == k:
            raise KeyboardInterrupt(f"at landing {k}")

    return profile


def cut_at_landing(k: int, watched: Union[str, Tuple[str, ...]], step: Callable[[], Any]
                   ) -> Tuple[bool, bool]:
    """Runs ``step()`` with a ``KeyboardInterrupt`` at the ``k``-th place one can land in
    ``watched`` (:func:`interrupt_at_landing`). Whether the interrupt landed (``step`` was cut
    short), and whether ``step`` has no ``k``-th place (the walk k = 1, 2, ... is over)."""
    landings = [0]
    sys.setprofile(interrupt_at_landing(k, landings, watched))
    try:
        step()
        cut = False
    except KeyboardInterrupt:
        cut = True
    finally:
        sys.setprofile(None)
    return cut, landings[0] < k
