"""Batches going to a GPU by DMA: a source's shared memory page-locked once, and host batches
kept alive while a copy reads them.

Two rules make a copy from shared memory to a GPU both fast and right:

* **Page-locked once.** A copy from page-locked (pinned) host memory is a DMA
  that runs asynchronously to the CPU; from pageable memory, CUDA first copies
  through a staging buffer, on the CPU. :func:`page_lock` registers every
  mapping of a source's shared memory with CUDA (``cudaHostRegister``) as it
  is made, and unregisters it right before it is unmapped
  (:meth:`extsrc.ParallelSource.watch_memory`): no per-batch pinning copy.
* **Alive until copied.** An asynchronous copy reads the host batch after the
  call that queued it returned; the batch's memory must not be reused before
  the copy has finished. :class:`InFlight` keeps a reference to each host batch
  until the event recorded after its copy has completed: the engine reuses
  memory only when no reference is left.

This module imports nothing heavy; the CUDA calls come from the caller
(PyTorch's or CuPy's runtime bindings).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Tuple

from extsrc.engine import ParallelSource

CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class PageLock:
    """The page-locking of one source's shared memory (made by :func:`page_lock`).

    ``register(address, size)`` and ``unregister(address)`` are the CUDA calls;
    they run in whatever thread maps or unmaps the memory (the pool's thread,
    a consumer's), so they must select their device themselves. A failed
    registration cannot be raised there: it is kept and raised by
    :meth:`check`, which a consumer calls before each batch.
    """

    def __init__(self, library: str, register: Callable[[int, int], None],
                 unregister: Callable[[int], None]):
        self.library = library
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._registered: Dict[int, int] = {}  # address -> size
        self._errors: List[str] = []

    def on_map(self, address: int, size: int) -> None:
        try:
            self._register(address, size)
        except Exception as exc:  # never raised into the thread that maps
            with self._lock:
                self._errors.append(f"{size} bytes at {address:#x}: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            self._registered[address] = size

    def on_unmap(self, address: int, size: int) -> None:
        with self._lock:
            registered = self._registered.pop(address, None) is not None
        if registered:
            try:
                self._unregister(address)
            except Exception:
                pass  # the memory goes anyway; at interpreter exit the runtime may be gone

    def registered_bytes(self) -> int:
        """Bytes of this source's shared memory registered as page-locked now."""
        with self._lock:
            return sum(self._registered.values())

    def check(self) -> None:
        """Raises ``RuntimeError`` (once per failure) if registering some memory failed.

        Batches in that memory are still copied right, through CUDA's staging
        buffer (slower); ``pin_memory=False`` avoids the attempt.
        """
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise RuntimeError(
                f"could not page-lock extsrc shared memory for CUDA ({self.library}): "
                + "; ".join(errors)
                + ". Batches in that memory are copied through CUDA's staging buffer instead. "
                "Raise the locked-memory limit (ulimit -l, the container's memlock), or pass "
                "pin_memory=False"
            )


_locks: "weakref.WeakKeyDictionary[ParallelSource, PageLock]" = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def page_lock(source: ParallelSource, library: str, register: Callable[[int, int], None],
              unregister: Callable[[int], None]) -> PageLock:
    """Page-locks ``source``'s shared memory, now and whenever more is mapped, until unmapped.

    Idempotent per source (CUDA refuses to register memory twice, whichever
    library asks): a second call returns the first :class:`PageLock`. Lasts as
    long as the source's memory; raises what ``source.watch_memory`` raises
    (a closed source, a forked child).
    """
    if not isinstance(source, ParallelSource):
        raise TypeError(f"page_lock needs an extsrc.ParallelSource, got {type(source).__name__}")
    with _locks_guard:
        lock = _locks.get(source)
        if lock is None:
            lock = PageLock(library, register, unregister)
            source.watch_memory(lock.on_map, lock.on_unmap)
            _locks[source] = lock
        return lock


def _completed(event: Any) -> bool:
    """Whether a CUDA event has completed: ``torch.cuda.Event.query()``, ``cupy.cuda.Event.done``."""
    query = getattr(event, "query", None)
    return bool(query()) if query is not None else bool(event.done)


class InFlight:
    """Host batches kept referenced until the GPU copies that read them have completed.

    ``add(event, host)`` after queuing the copies of ``host`` and recording
    ``event`` (a ``torch.cuda.Event`` or a ``cupy.cuda.Event``) on the copying
    stream. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: Deque[Tuple[Any, Any]] = deque()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def add(self, event: Any, host: Any) -> None:
        with self._lock:
            self._entries.append((event, host))

    def release_done(self) -> None:
        """Drops the host batches whose copies have completed (does not wait)."""
        with self._lock:
            previous = self._entries
            self._entries = deque(entry for entry in previous if not _completed(entry[0]))
        del previous  # the finished host batches go here, outside the lock

    def wait_all(self) -> None:
        """Waits for every copy to complete, then drops the host batches."""
        with self._lock:
            entries, self._entries = list(self._entries), deque()
        for event, _host in entries:
            event.synchronize()
