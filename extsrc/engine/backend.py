"""What a worker pool asks of its workers' backend, and how a backend is found by name.

:class:`~extsrc.engine.pool.WorkerPool` owns everything a source sees: its
states, the lock and the waiters, the queue of tasks and which worker holds
which (scheduling), and its one I/O thread. A *backend* owns the workers
themselves: how they start and stop, how a task and a slot's memory reach
them, how their answers come back, and how their death is noticed. Worker
processes on this host (:mod:`extsrc.engine.processes`, ``"processes"``) and
Ray actors (:mod:`extsrc.ray.backend`, ``"ray"``) are the two backends.

Who calls what, from which thread (the pool's lock is the pool's
:attr:`~extsrc.engine.pool.WorkerPool.lock`):

=========================  ==============================  ===========
method                     caller                          pool's lock
=========================  ==============================  ===========
``check_options``          ``PoolOptions.create``          no
constructor                ``WorkerPool()``                no
``start``                  ``WorkerPool.start()`` (any)    held
``add_slot``/``drop_slot`` a source (any thread)           held
``take_back``              a source (any thread)           held
``assign``, ``flush``      the I/O thread                  held
``wait``, ``receive``      the I/O thread                  **not** held
``check``, ``replace``     the I/O thread                  held
``stop``                   the I/O thread at its end;      not held;
                           ``close()`` after it (again)    held
``describe_worker``        any thread                      held
``forget_after_fork``      a forked child                  no
=========================  ==============================  ===========

Ownership: the backend owns its workers, their connections and every
descriptor or mapping it made for them (``add_slot`` duplicates what it
keeps; the slot's own descriptors stay the source's). It never reaches into
the pool: what it needs of it comes as arguments (the waker that wakes the
I/O thread, a function describing what a worker held). ``wait`` and
``receive`` run without the lock because they may block or copy for a long
time; nothing else touches what they touch (the I/O thread is the only one
that talks to the workers).

Registry: a backend is chosen by name (``WorkerPool(backend="ray")``);
:func:`backend_class` imports the module of a built-in backend by its
dotted name on first use (so the engine imports no backend's module, and
``import extsrc`` imports no Ray), and :func:`register_backend` adds others.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable,
)

from extsrc.engine.protocol import Result, SourceSetup, Task

if TYPE_CHECKING:
    from extsrc.engine.pickling import Pickler

# Describes what worker ``index`` held when it was lost: "samples 0..3 of batch 1 of ...", or
# "no samples". Given by the pool, which alone knows which tasks a worker holds.
HeldBy = Callable[[int], str]
# A fault of the backend, as a function of what the workers held: the pool calls it, with the
# lock held, to get the error it breaks with (see Received.fault and WorkerBackend.check).
Fault = Callable[[HeldBy], BaseException]


class Lost:
    """The fault of worker ``worker`` lost (died, killed, its connection gone): the pool may
    replace it (:meth:`WorkerBackend.replace`) rather than break, within its
    ``worker_restarts``."""

    def __init__(self, worker: int, fault: Fault):
        self.worker = worker
        self.fault = fault

    def __call__(self, held: HeldBy) -> BaseException:
        return self.fault(held)


class Wakeable(Protocol):
    """What wakes the pool's I/O thread (:class:`extsrc.engine.workers.Waker`): safe from any
    thread at any time, also after the pool stopped."""

    def wake(self) -> None: ...

    def fileno(self) -> int: ...

    def drain(self) -> None: ...


@dataclass(frozen=True)
class Arrival:
    """One task's answer: ``result`` for task ``ticket`` of worker ``worker``; ``None`` when the
    backend could not deliver it because its slot is gone (its source was closed)."""

    worker: int
    ticket: int
    source_id: int
    result: Optional[Result]


@dataclass(frozen=True)
class Received:
    """What :meth:`WorkerBackend.receive` found: answers, in the order they came, and a fault
    that breaks the pool (a worker lost, sources that could not be loaded), if any; the
    answers that came before the fault still count."""

    arrivals: Tuple[Arrival, ...] = ()
    fault: Optional[Fault] = None
    woken: bool = False  # whether anything came at all (a wake-up included)


@runtime_checkable
class WorkerBackend(Protocol):
    """The workers of one pool (see the module docstring for threads and ownership).

    Workers are numbered ``0 .. num_workers - 1``; tasks reach a worker in
    the order they were assigned to it, after every ``add_slot`` made before
    their assignment. A worker answers each task exactly once, unless the
    pool breaks first.
    """

    name: str  # the name the backend is registered under
    max_outstanding: int  # tasks a worker holds at most (running, queued, answered in transit)
    local_processes: bool  # the workers are processes of this host (their /proc can be read)
    concurrent_samples: bool  # a worker runs a task's samples concurrently (concurrency > 1,
    # async def callbacks); without it, sources that ask for that are refused when made

    def start(self, sources: Tuple[SourceSetup, ...], waker: Wakeable) -> Optional[KeyboardInterrupt]:
        """Starts the workers with ``sources``; raises with nothing left running. ``waker``
        wakes the I/O thread (from any thread) once something arrived. Returns ``None``, or a
        ``KeyboardInterrupt`` that landed while the workers started and was held, not raised
        (the workers are running): the pool raises it once its start is committed."""

    def add_slot(self, source_id: int, slot_id: int, region_fd: int,
                 overflow_fds: Sequence[int]) -> None:
        """A new slot: every worker may write into it from its next task on. The descriptors
        stay the caller's (the backend duplicates what it keeps). Raises ``OSError`` (out of
        descriptors) with no worker told."""

    def drop_slot(self, source_id: int, slot_id: int) -> None:
        """The slot is retired: no task for it is outstanding; workers forget it."""

    def assign(self, worker: int, task: Task) -> None:
        """Queues ``task`` for ``worker`` (sent by the next :meth:`flush`)."""

    def take_back(self, source_id: int) -> List[Task]:
        """Removes the source's tasks assigned and not yet sent to a worker; returns them."""

    def flush(self) -> Optional[Fault]:
        """Sends what is queued for each worker; the fault if a worker could not be reached."""

    # The events are each backend's own, only handed from its wait() to its receive().
    def wait(self, timeout: Optional[float]) -> Any:
        """Blocks until a worker may have answered, the waker was woken, or ``timeout`` (s,
        ``None``: no limit) passed; returns what :meth:`receive` needs."""

    def receive(self, events: Any) -> Received:
        """The answers that came (with ``events`` from :meth:`wait`), written into the slots
        where the backend does that itself."""

    def poll_period(self) -> Optional[float]:
        """Lock held: how often :meth:`check` must run while nothing arrives (``None``: never)."""

    def check(self) -> Optional[Fault]:
        """Lock held: a fault found without an answer (Ray gone, an actor that never started)."""

    def stop(self, ask: bool) -> None:
        """Stops every worker (asked first if ``ask``, to finish what runs) and gives back what
        the backend holds. Idempotent; after it, ``worker_pids()`` is empty."""

    def worker_pids(self) -> List[int]:
        """The workers' pids (each on its own host for remote workers); empty when stopped."""

    def describe_worker(self, worker: int) -> str:
        """``worker`` in an error message: which worker, and where it runs."""

    def forget_after_fork(self) -> None:
        """In a forked child: drop every reference to the parent's workers, touching nothing."""

    def replace(self, worker: int) -> bool:
        """Lock held, I/O thread: starts a new worker in the place of ``worker``, lost (see
        :class:`Lost`), with the sources and every live slot; the lost one's unsent messages are
        dropped. ``False`` when this backend cannot (the pool then breaks as without restarts);
        raises when the new worker cannot be started."""


class BackendClass(Protocol):
    """What a backend registers: its options checked once, and a way to make it."""

    def check_options(self, start_method: object, options: object, names: Tuple[str, str, str],
                      unset: object) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
        """``(start_method, options)`` checked for this backend, or ``ValueError``/``TypeError``
        naming ``names`` (what the backend and the two arguments are called where they were given); ``unset``
        marks an argument not given. The options are keyword arguments the backend passes
        on, e.g. to Ray."""

    def __call__(self, num_workers: int, start_method: Optional[str], pickler: Pickler,
                 options: Optional[Dict[str, Any]]) -> WorkerBackend: ...


# Built-in backends: their modules, imported by name on first use (the engine imports none).
BUILT_IN = {
    "processes": "extsrc.engine.processes:ProcessBackend",
    "ray": "extsrc.ray.backend:RayBackend",
}
_registered: Dict[str, Union[str, BackendClass]] = {}
_lock = threading.Lock()


def register_backend(name: str, backend: Union[str, BackendClass]) -> None:
    """Makes ``WorkerPool(backend=name)`` use ``backend``: a class with the constructor and
    ``check_options`` of :class:`BackendClass`, or ``"module:Class"`` imported on first use."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a backend's name must be a non-empty str, got {name!r}")
    with _lock:
        _registered[name] = backend


def unregister_backend(name: str) -> None:
    """Undoes :func:`register_backend` (pools made before keep their backend); ``KeyError`` if
    ``name`` was not registered, ``ValueError`` for a built-in backend."""
    if name in BUILT_IN:
        raise ValueError(f"backend {name!r} is built in and cannot be unregistered")
    with _lock:
        del _registered[name]


def backend_names() -> Tuple[str, ...]:
    """The names a pool's ``backend`` may take."""
    with _lock:
        return tuple(dict.fromkeys((*BUILT_IN, *_registered)))


def backend_class(name: str, argument: str = "backend") -> BackendClass:
    """The backend registered as ``name`` (its module imported now if it was not), or
    ``ValueError`` naming ``argument`` and the names there are."""
    with _lock:
        entry = _registered.get(name, BUILT_IN.get(name) if isinstance(name, str) else None)
    if entry is None:
        raise ValueError(f"{argument} must be one of {backend_names()}, got {name!r}")
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        loaded: BackendClass = getattr(importlib.import_module(module), attribute)
        with _lock:
            _registered.setdefault(name, loaded)
        return loaded
    return entry
