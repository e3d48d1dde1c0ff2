"""What becomes of extsrc's resources when the process forks.

Any process may fork after it created sources: a pool starting ``fork``
workers, ``os.fork()`` by the user, a library (a PyTorch ``DataLoader``,
``multiprocessing`` with ``fork``). The rules:

* **Owner process.** Every resource (segment, mapping, pool) records the pid
  that created it. Closing a descriptor, unmapping memory, stopping or
  signalling a worker happen only in that process; in any other they are
  no-ops, so a child's garbage collector or exit never touches the parent's
  workers or memory.
* **In every child**, right after the fork (:func:`_forget_in_child`),
  registered resources forget what they held: descriptors of segments and
  of worker sockets are closed (a child holding a worker's socket would keep
  that worker alive after the parent died), and pools refuse any use with
  :class:`~extsrc.errors.ForkedChildError`.
* **Memory in a child.** Right before each fork, every mapping is marked
  ``MADV_DONTFORK`` unless a batch the consumer holds lives in it, so a
  child inherits only the memory of held batches: those stay readable in
  the child (a validation set kept in memory, then a ``DataLoader`` forked
  over it), the rest (free and in-flight slots) is not kept alive by it.
* **Fork generation.** :func:`generation` counts the forks of this process.
  A lease taken before a fork may be referenced by the child, which the
  parent cannot see; so when such a lease ends, its memory is retired
  (replaced by new memory) rather than reused.
* A pool's own fork workers also unmap what they inherited
  (:func:`drop_inherited_memory`): a worker holds the memory of its own
  sources only.

Only forks made through ``os.fork()`` from Python (which is what
``multiprocessing`` and most libraries use) run these hooks; ``subprocess``
and spawn start a new program, which inherits nothing (descriptors are
close-on-exec).
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import weakref
from typing import Any, Callable, List, Optional, Protocol

# Held across every fork, and while a descriptor is created and registered, so that no child
# is forked between the two (it would inherit a descriptor it does not know to close).
_lock = threading.RLock()
lock = _lock
# One entry per fork of this process, appended by a C call in a fork hook (see the bottom).
_forks: "list[None]" = []
_forgetful: "weakref.WeakSet[ForgetsAfterFork]" = weakref.WeakSet()
_droppable: "weakref.WeakSet[DroppableMemory]" = weakref.WeakSet()


class ForgetsAfterFork(Protocol):
    """A resource that must let go of the parent's descriptors in a forked child."""

    def forget_after_fork(self) -> None:
        """Called in the child right after a fork, with no lock held; must not block."""


class DroppableMemory(Protocol):
    """Shared memory mapped in this process (see :func:`drop_inherited_memory`)."""

    def before_fork(self) -> None:
        """Decides whether the child about to be forked inherits it (fork lock held)."""

    def drop_in_worker(self) -> None:
        """In a pool's fork worker: unmaps it if it was inherited."""


def generation() -> int:
    """How many times this process has forked (from Python) so far."""
    return len(_forks)


def register(resource: ForgetsAfterFork) -> None:
    """Has ``resource.forget_after_fork()`` called in every child forked from now on."""
    with _lock:
        _forgetful.add(resource)


def close_inherited(fds: "tuple[int, ...] | list[int]") -> None:
    """In a forked child (from ``forget_after_fork``): closes descriptors of the parent's that it
    inherited; one already closed is no error (a child must come up whatever it holds)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def register_memory(mapping: DroppableMemory) -> None:
    """Has a pool's fork worker unmap ``mapping`` at start (see :func:`drop_inherited_memory`)."""
    with _lock:
        _droppable.add(mapping)


def drop_inherited_memory() -> None:
    """In a pool's fork worker: unmaps every mapping inherited from the parent.

    Only mappings of held batches are inherited at all (``MADV_DONTFORK``
    keeps the rest out); a worker never reads them, and keeping them mapped
    would keep their memory alive for the worker's lifetime.
    """
    for mapping in list(_droppable):
        mapping.drop_in_worker()


def start_forking(start: Callable[[], object]) -> Optional[KeyboardInterrupt]:
    """Runs ``start()``, which forks (a fork worker's ``Process.start()``), so that an interrupt
    landing in another library's fork hook is neither lost nor leaves that library stuck.
    Returns such an interrupt, for the caller to raise once it recorded the new process.

    Python runs every library's fork hooks (``os.register_at_fork``) and prints and drops
    what one raises ("Exception ignored in"). A Ctrl-C that landed in one was lost, and one
    that landed in :mod:`logging`'s, which gives back logging's module lock after the fork,
    left that lock held by this thread for good: the next fork from any other thread (the
    pool's I/O thread replacing a lost worker) waited for it forever, and the pool with it.
    Here an interrupt a hook of this thread drops is kept and returned, and logging's lock,
    if the fork left it held, is given back. Only the main thread needs this: signal
    handlers run there alone. Any thread: the garbage collector is off across the fork.
    """
    collecting = gc.isenabled()
    try:
        # Off across the fork: the worker begins with the collector off and freezes what it
        # inherited (worker_main) before one collection could finalize an object of this
        # process there (a DALI pipeline's finalizer waits for threads a child does not have).
        gc.disable()
        if threading.current_thread() is not threading.main_thread():
            start()
            return None
        return _keeping_hook_interrupts(start)
    finally:
        if collecting:
            gc.enable()


def _keeping_hook_interrupts(start: Callable[[], object]) -> Optional[KeyboardInterrupt]:
    """:func:`start_forking` in the main thread: the interrupts the fork hooks drop are kept,
    and logging's lock is given back if the fork left it held."""
    dropped: List[KeyboardInterrupt] = []
    pid, ident, previous = os.getpid(), threading.get_ident(), sys.unraisablehook

    def keep(unraisable: Any) -> None:  # sys.UnraisableHookArgs; the child inherits it too
        if (isinstance(unraisable.exc_value, KeyboardInterrupt) and os.getpid() == pid
                and threading.get_ident() == ident):
            dropped.append(unraisable.exc_value)
        else:
            previous(unraisable)

    lock = _logging_lock()
    held_before = lock is None or lock._is_owned()
    sys.unraisablehook = keep
    try:
        start()
    finally:
        sys.unraisablehook = previous
        if not held_before:
            try:
                lock._release_save()  # one C call: gives it back if the fork left it held
            except RuntimeError:
                pass  # not held: logging's hook ran
    return dropped[0] if dropped else None


def _logging_lock() -> Any:
    """:mod:`logging`'s module lock (its private ``_lock``, an ``RLock``), if logging is
    imported and the lock is one; else None."""
    module = sys.modules.get("logging")
    lock = getattr(module, "_lock", None)
    return lock if hasattr(lock, "_is_owned") and hasattr(lock, "_release_save") else None


def _advise_memory_before_fork() -> None:
    for mapping in list(_droppable):
        try:
            mapping.before_fork()
        except Exception:  # the fork must happen whatever a mapping says
            pass


def _forget_in_child() -> None:
    for resource in list(_forgetful):
        try:
            resource.forget_after_fork()
        except Exception:  # a child must come up whatever a resource says
            pass


# Python runs the ``before`` hooks in the reverse order of their registration and the ``after``
# ones in order: the lock is taken first and released first, so the two Python hooks run with it
# held (before) and not held (in the child). Taking and releasing the lock and counting the fork
# are C calls on purpose: a ``KeyboardInterrupt`` is raised only where Python code runs (a hook's
# exception is then printed and dropped), so none can skip them. A skipped release would leave
# the lock held for good, and hang the next thread that needs it (a pool starting a worker).
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_advise_memory_before_fork)
    os.register_at_fork(before=functools.partial(_forks.append, None))
    os.register_at_fork(before=_lock.acquire, after_in_parent=_lock.release,
                        after_in_child=_lock.release)
    os.register_at_fork(after_in_child=_forget_in_child)
