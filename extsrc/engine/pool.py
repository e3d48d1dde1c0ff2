"""The worker pool: start, schedule, move messages, detect death, shut down.

One pool serves one or more sources (its *clients*). It knows tasks, slots
and workers, not epochs or batches.

Threads and ownership:

* **The pool's I/O thread** (one per started pool) owns the workers'
  channels: it alone sends and receives. It assigns queued tasks to
  workers, delivers results to their sources (:meth:`PoolClient.on_result`),
  lets sources reuse memory and dispatch more (:meth:`PoolClient.service`),
  and notices a dead worker within one wake-up. Asynchronous exceptions
  (``KeyboardInterrupt``) are delivered to the main thread only, so none of
  this bookkeeping can be cut in half by one.
* **Consumer threads** (calling ``next()``, ``iter()``, ``close()`` on
  sources) change the pool only through the methods below marked *lock
  held*. To wait, a consumer takes a :meth:`WorkerPool.waiter` with the
  lock held and acquires it after leaving the lock; the I/O thread releases
  every waiter after each change a consumer may wait for (what a round
  delivered, right before it next waits itself, where it lets go of the GIL
  the woken consumer needs). A consumer waits
  at most :data:`IO_WATCH_S` at a time and then looks again: an I/O thread
  that ended without a word (out of memory even for that) breaks the pool
  at that look instead of leaving its consumers waiting.
* One lock (:attr:`WorkerPool.lock`, a C-level ``RLock`` only ever used in
  ``with`` statements) guards the pool and every source attached to it. A
  ``KeyboardInterrupt`` landing anywhere in a consumer therefore never
  leaves it held: ``threading.Condition`` is not used, because its Python
  code can be interrupted between taking and giving back the lock.

Pool states::

    NEW ──start()──► RUNNING ──close(), or every source collected──► CLOSED
     │                  │                                              ▲
     │                  └─fault─► BROKEN ──────────────────────────────┤ close()
     └──────────────close()────────────────────────────────────────────┘

Sources are attached before the start, so a running pool whose sources were
all collected (dropped without ``close()``, or their ``close()`` cut short by
an interrupt) serves nobody any more: its I/O thread, woken by the collection,
stops the workers and ends (a later ``close()`` finishes the rest).

A fault is a worker that died, a worker that could not load the sources, a
source's timeout, or an internal error: the pool keeps the error, stops
the workers and refuses further use (each source raises the error itself
once, then :class:`~extsrc.errors.PoolClosedError`).

Scheduling: every worker holds up to its backend's ``max_outstanding``
tasks (for worker processes two: one running, one queued, so it never waits
for the parent), and more when its tasks are short: enough to run
:data:`~extsrc.engine.policy.QUEUE_COVER_S`, while the I/O thread, woken, waits for a free CPU
rather than preempting a worker (``threads.defer_on_wake_up``: one wake-up
then handles the answers of several tasks); tasks go to
the least loaded worker in the order they were submitted, except tasks
pinned to a worker (iterable sources, whose state lives in one worker).

Workers: the pool owns its states, scheduling and I/O thread; who the
workers are (processes of this host, Ray actors) is its *backend*'s, chosen
by name through :mod:`extsrc.engine.backend`, whose protocol says which
thread calls what.
"""

from __future__ import annotations

import _thread
import atexit
import collections
import enum
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import (TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Protocol, Sequence, Set, Tuple,
                    cast)

from extsrc.engine import policy
from extsrc.engine import workers as worker_processes
from extsrc.engine.backend import Arrival, Fault, Lost, WorkerBackend, backend_class
from extsrc.engine.fair_queue import FairQueue
from extsrc.engine.protocol import Result, SourceSetup, Task
from extsrc.engine.threads import OwnedThread, defer_on_wake_up
from extsrc.engine.workers import Waker
from extsrc.errors import ForkedChildError, InternalError, PoolClosedError
from extsrc import forking
from extsrc.shm.limits import DESCRIPTOR_ERRNOS, out_of_descriptors, thread_start_error
from extsrc.engine.spec import UNSET, PoolSpec
from extsrc.closing import ClosedWhenCollected, close_at_exit

if TYPE_CHECKING:
    from _thread import LockType as Waiter

    from extsrc.engine.pickling import Pickler, PicklerSpec

# While the consumer holds batches, the I/O thread looks for ended leases at least this often
# (a lease's end wakes no thread, see extsrc.shm.slots.Lease); any other event is sooner.
RETURN_POLL_S = 0.05
# close() waits this long for the I/O thread, which stops the workers with their graces.
IO_THREAD_JOIN_S = 4 * worker_processes.STOP_GRACE_S + 2.0
# A waiting consumer looks this often whether the I/O thread still runs: out of memory
# (ulimit -v) it can end where it has no memory left to tell anyone. One wake-up a second of
# a thread that waits anyway costs nothing measurable.
IO_WATCH_S = 1.0

class PoolState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    BROKEN = "broken"
    CLOSED = "closed"


_log = logging.getLogger("extsrc")


class PoolClient(Protocol):
    """A source attached to a pool: what the pool asks of it.

    Called by the pool's I/O thread with the pool's lock held, except
    :meth:`worker_source` (by :meth:`WorkerPool.start`, in the thread
    calling it) and :meth:`on_pool_closed` (by ``close()``, lock held, after
    the workers stopped).
    """

    name: str
    redoable: bool  # a task of it may run again in another worker (its state is not a worker's)

    def worker_source(self, pickler: Optional[Pickler]) -> SourceSetup:
        """What each worker needs to run this source (pickles it for spawn/forkserver)."""

    def on_result(self, message: Result) -> bool:
        """A task of this source reported back; True if a consumer may now be able to go on."""

    def service(self) -> bool:
        """Take back returned memory and dispatch more work, if any; cheap when there is none.
        True if a consumer may now be able to go on (a dispatch failed)."""

    def lends(self) -> bool:
        """Whether the consumer holds batches of this source (their end must be noticed)."""

    def describe_task(self, task: Task) -> str:
        """``"samples 0..3 of batch 1 of epoch 0 (idx_in_epoch 8..11) of source #0"``."""

    def on_pool_closed(self) -> None:
        """The workers are gone: give back all shared memory no batch holds."""


class _Load:
    """What one worker holds, as the pool's scheduler sees it (I/O thread and sources, lock held)."""

    def __init__(self, index: int):
        self.index = index
        self.outstanding: Dict[int, Task] = {}  # ticket -> task assigned, in the order assigned
        self.pinned: Set[int] = set()  # of those, the tickets of tasks for this worker only
        self.busy_since = time.monotonic()


class _TaskTime:
    """How long one source's tasks take in a worker (a moving average), and so how many of
    them a worker may hold (:func:`extsrc.engine.policy.task_depth`). I/O thread, lock held."""

    def __init__(self, base_depth: int):
        self.base_depth = base_depth
        self.seconds = 0.0  # 0.0: no task timed yet
        self.depth = base_depth

    def note(self, busy_ns: int) -> None:
        self.seconds = policy.task_seconds(self.seconds, busy_ns * 1e-9)
        self.depth = policy.task_depth(self.seconds, self.base_depth)


class WorkerPool(ClosedWhenCollected):
    """Workers shared by one or more :class:`~extsrc.ParallelSource` s.

    Create the pool, create the sources with ``pool=pool``, then ``start()``
    (or let the first iteration start it). Sources must exist before the
    pool starts: workers receive all sources once, at start.

    ``start_method``: ``"fork"`` (fast; refused once CUDA is initialised),
    ``"spawn"`` or ``"forkserver"`` (sources are pickled with ``pickler``,
    see :class:`extsrc.engine.pickling.Pickler`). ``close()`` stops the
    workers and frees the shared memory of every source (batches still held
    keep theirs until dropped); it is idempotent, and also runs when the pool
    is garbage and at interpreter exit. A pool belongs to the process that
    created it: in a forked child every use raises
    :class:`~extsrc.errors.ForkedChildError`, and nothing the child does
    stops or signals the parent's workers.

    The methods marked *engine* form the contract with sources; each says
    who calls it and whether the pool's lock must be held.

    ``backend`` names who the workers are (see :mod:`extsrc.engine.backend`):
    ``"processes"`` (the default) runs worker processes on this host;
    ``"ray"`` makes them Ray actors anywhere in a cluster (with
    ``ray_options`` for them, see :class:`extsrc.ray.RayBackend`; needs
    ``extsrc[ray]``). :attr:`workers_backend` is the backend itself.
    """

    def __init__(self, num_workers: int = 1, start_method: Optional[str] = UNSET,
                 pickler: "PicklerSpec" = None, backend: str = "processes",
                 ray_options: Optional[Dict[str, Any]] = None,  # options of the Ray actors
                 worker_restarts: int = 0):
        self._made(PoolSpec(num_workers, start_method, pickler, backend, ray_options, worker_restarts))

    @classmethod
    def from_spec(cls, spec: PoolSpec) -> "WorkerPool":
        """A pool that runs its workers as ``spec`` (checked when it was made) says."""
        if not isinstance(spec, PoolSpec):
            raise TypeError(f"spec must be an extsrc.PoolSpec, got {type(spec).__name__}")
        pool = cls.__new__(cls)
        pool._made(spec)
        return pool

    def _made(self, spec: PoolSpec) -> None:
        """The new pool's state, its workers as ``spec`` says (from __init__ and from_spec)."""
        self.spec = spec
        self.restarts: List[str] = []  # each lost worker replaced: what happened to it
        maker = backend_class(self.spec.backend)
        self._backend: WorkerBackend = maker(self.spec.num_workers, self.spec.start_method,
                                             self.spec.pickler, self.spec.backend_options)
        self.lock = threading.RLock()
        self._waiters: List[Waiter] = []
        self._pid = os.getpid()
        self._state = PoolState.NEW
        self._closed_fully = False  # close() ran to its end (_state is CLOSED from its start)
        self._error: Optional[BaseException] = None
        self._reported: Set[int] = set()  # clients that raised the fault already
        self._clients: List["weakref.ReferenceType[PoolClient]"] = []
        self._client_gone = _waking(weakref.ref(self))  # the callback of those references
        self._loads: List[_Load] = []
        self._queue = FairQueue()  # tasks for any worker, each source's in order, sources in turn
        self._pinned: Dict[int, Deque[Task]] = {}
        self._pins = 0
        self._tickets = itertools.count()
        self._waker: Optional[Waker] = None
        self._thread: Optional[OwnedThread] = None
        self._io_ident: Optional[int] = None
        self._io_defers = False  # I/O thread only: whether it asked to defer on wake-up
        self._task_times: Dict[int, _TaskTime] = {}  # source id -> its tasks' time (lock held)
        self._io_token: Optional[object] = None  # the I/O thread's that start() committed
        self._delivered = False  # I/O thread: the last round delivered what a consumer waits for
        # What consumers get if the I/O thread fails with no memory left to describe why, or
        # ends without telling them (made here, while there is memory: under `ulimit -v` the
        # failure itself may be a MemoryError).
        self._io_failed = InternalError(
            "the extsrc pool's I/O thread failed and had no memory left to say why (MemoryError); "
            "under an address-space limit (ulimit -v) raise it or lower prefetch or batch_size")
        _live_pools.add(self)
        forking.register(self)

    # -- what users see -------------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return self.spec.num_workers

    @property
    def start_method(self) -> Optional[str]:
        return self.spec.start_method

    @property
    def backend(self) -> str:
        """The backend's name: ``"processes"``, ``"ray"``, or one registered."""
        return self.spec.backend

    @property
    def workers_backend(self) -> WorkerBackend:
        """The backend that runs the workers (e.g. :class:`extsrc.ray.RayBackend`, whose
        ``actors()`` says where each runs)."""
        return self._backend

    @property
    def max_outstanding(self) -> int:
        """Tasks a worker holds at most (the backend's figure)."""
        return self._backend.max_outstanding

    @property
    def pickler(self) -> "Pickler":
        return cast("Pickler", self.spec.pickler)  # PoolSpec made it one

    @property
    def state(self) -> PoolState:
        return self._state

    @property
    def started(self) -> bool:
        return self._state is PoolState.RUNNING

    def worker_pids(self) -> List[int]:
        """The pids of the workers (empty before start and after close)."""
        return self._backend.worker_pids()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- life cycle -----------------------------------------------------------------------------

    def start(self, client_id: Optional[int] = None) -> None:
        """Starts the workers; no-op if running. Raises if closed or broken: a source
        (``client_id``) that has not raised the fault of a broken pool yet gets the fault
        itself, whenever it broke (see :meth:`check_usable`).

        With ``fork``, call it before CUDA is initialised. Pickling errors of a
        source (spawn, forkserver, ray) are raised here, with the pool still NEW.
        A ``KeyboardInterrupt`` raised here leaves the pool NEW, or RUNNING when
        it landed while ``forkserver`` workers started, or in another library's fork
        hook while ``fork`` workers did (held until they all had).
        """
        with self.lock:
            self.check_owner()
            if self._state is PoolState.RUNNING:
                return
            self.check_usable(client_id)
            pickler = None if self.spec.start_method == "fork" else self.spec.pickler
            clients = [ref() for ref in self._clients]
            sources: Tuple[SourceSetup, ...] = tuple(
                c.worker_source(pickler) for c in clients if c is not None)
            try:
                self._waker = Waker()
            except OSError as exc:
                if exc.errno in DESCRIPTOR_ERRNOS:
                    raise out_of_descriptors(exc, "the pool's wake-up pipe", OSError) from exc
                raise
            # Everything is made first and committed at the end in plain stores, where no
            # interrupt can land: an interrupt (KeyboardInterrupt) anywhere before leaves the
            # pool NEW, its workers stopped. The I/O thread starts before the commit and waits
            # for the lock held here; one whose start was not committed ends without touching
            # anything (see _run). An interrupt the backend held while its workers started is
            # raised after the commit, as one landing there would be: the pool runs.
            token, running = object(), PoolState.RUNNING
            try:
                held = self._backend.start(sources, self._waker)
                loads = [_Load(index) for index in range(self.spec.num_workers)]
                thread = OwnedThread(lambda: self._run(token), "extsrc-pool-io")
                try:
                    thread.start()
                except RuntimeError as exc:  # no thread could be made (e.g. RLIMIT_AS)
                    raise thread_start_error(exc, "the pool's I/O thread") from None
            except BaseException:
                self._backend.stop(ask=False)
                self._waker.close()
                self._waker = None
                raise
            self._loads, self._thread, self._state, self._io_token = loads, thread, running, token
            if held is not None:
                raise held

    def close(self) -> None:
        """Stops the workers and frees the shared memory of every source. Idempotent.

        In a forked child it does nothing (the workers are the parent's).
        """
        if self._pid != os.getpid():
            return
        with self.lock:
            if self._closed_fully:
                return
            # A close() interrupted (KeyboardInterrupt) after this point is finished by the next
            # call: each step below may be repeated.
            self._state = PoolState.CLOSED
            if self._error is None:
                self._error = PoolClosedError("the pool was closed")
            self.notify()
        thread = self._thread
        if self._waker is not None:
            self._waker.wake()
        if thread is not None:
            thread.join(IO_THREAD_JOIN_S)  # at once on the I/O thread itself
        if self._waker is not None and (thread is None or thread.ended):
            self._waker.close()  # nothing polls it any more (else the I/O thread closes it)
        with self.lock:
            # The I/O thread stopped the workers, unless it never ran or did not end in time.
            self._backend.stop(ask=False)  # idempotent
            self._loads = []
            for i in range(len(self._clients)):
                client = self._clients[i]()
                if client is not None:
                    client.on_pool_closed()
            self._closed_fully = True
        _live_pools.discard(self)

    def forget_after_fork(self) -> None:
        # In a forked child (no lock taken: the parent's may be held by a thread not here).
        self._backend.forget_after_fork()
        self._loads = []
        self._thread = None

    # -- engine: checks -------------------------------------------------------------------------

    def check_owner(self) -> None:
        """*engine*, any thread, no lock: raises :class:`ForkedChildError` in a forked child."""
        if self._pid != os.getpid():
            raise ForkedChildError(
                f"this extsrc pool (and its sources) belongs to process {self._pid}; it cannot "
                f"be used in process {os.getpid()}, which was forked from it. Create the source "
                "in the child, or fork before creating it."
            )

    def check_usable(self, client_id: Optional[int]) -> None:
        """*engine*, lock held: raises the pool's fault (once per client), or
        :class:`PoolClosedError` if closed or broken. A pool whose I/O thread ended while it
        ran (see :meth:`wait`) breaks here with an :class:`InternalError`."""
        self.notice_io_end()
        if self._state is PoolState.BROKEN and client_id is not None and client_id not in self._reported:
            self._reported.add(client_id)
            assert self._error is not None, "a broken pool has its error"
            raise self._error
        if self._state in (PoolState.CLOSED, PoolState.BROKEN):
            error = self._error or PoolClosedError("the pool was closed")
            if isinstance(error, PoolClosedError):
                raise PoolClosedError(f"{error} (no batches can be taken after close())")
            raise PoolClosedError(
                f"the source's workers were shut down after an earlier error: "
                f"{type(error).__name__}: {error}"
            ) from error

    def notice_io_end(self) -> None:
        """*engine*, lock held: breaks a RUNNING pool whose I/O thread ended without saying so
        (with the :class:`InternalError` made in advance); a consumer that waits calls it at
        least every :data:`IO_WATCH_S` (see :meth:`wait`)."""
        thread = self._thread
        if self._state is PoolState.RUNNING and thread is not None and thread.ended:
            self._break(self._io_failed)

    @property
    def broken(self) -> bool:
        return self._state is PoolState.BROKEN

    @property
    def closed(self) -> bool:
        return self._state is PoolState.CLOSED

    # -- engine: clients ------------------------------------------------------------------------

    def attach(self, client: PoolClient) -> int:
        """*engine*, consumer thread: adds a source before start; returns its id."""
        with self.lock:
            self.check_owner()
            if self._state is not PoolState.NEW:
                raise RuntimeError("sources must be added to a WorkerPool before it starts")
            self._clients.append(weakref.ref(client, self._client_gone))
            return len(self._clients) - 1

    def new_ticket(self) -> int:
        """*engine*, I/O thread: a ticket for a new task, unique in this pool (backends and the
        scheduler tell tasks apart by ticket alone, whichever source they are of)."""
        return next(self._tickets)

    def pin_worker(self) -> int:
        """*engine*: a worker for a source whose state must stay in one process (round robin)."""
        worker = self._pins % self.spec.num_workers
        self._pins += 1
        return worker

    def waiter(self) -> Waiter:
        """*engine*, lock held: a held lock that the next change releases.

        The caller leaves the pool's lock, then acquires the waiter (with its
        timeout) to wait; a waiter left unused is harmless.
        """
        waiter = _thread.allocate_lock()
        waiter.acquire()
        self._waiters.append(waiter)
        return waiter

    def wait(self, waiter: Waiter, timeout: Optional[float]) -> None:
        """*engine*, consumer thread, lock not held: waits until ``waiter`` (from :meth:`waiter`)
        is released or ``timeout`` seconds passed (``None``: no limit), at most
        :data:`IO_WATCH_S` at a time. The caller then looks again (:meth:`check_usable` finds an
        I/O thread that ended without telling its waiters)."""
        if not waiter.acquire(True, IO_WATCH_S if timeout is None else min(max(0.0, timeout), IO_WATCH_S)):
            with self.lock:  # not released: the caller takes a new one to wait again
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def notify(self) -> None:
        """*engine*, lock held: wakes every consumer waiting for a change."""
        waiters = self._waiters
        while waiters:  # in place: waking them allocates nothing (the I/O thread may be out of memory)
            waiters.pop().release()

    def _take_waiters(self) -> List[Waiter]:
        """Lock held: the waiters to release once the lock is left (a consumer woken while the
        I/O thread still holds the lock would only block on it again)."""
        waiters, self._waiters = self._waiters, []
        return waiters

    def fail(self, error: BaseException) -> None:
        """*engine*, lock held: a source found a fault (a timeout): break the pool with ``error``.

        The I/O thread stops the workers; waiters wake up.
        """
        self._break(error)

    # -- engine: work and slots (lock held) -----------------------------------------------------

    def submit(self, task: Task, worker: Optional[int] = None) -> None:
        """*engine*, lock held: queues ``task`` (for ``worker`` only, if given)."""
        if worker is None:
            self._queue.append(task)
        else:
            self._pinned.setdefault(worker, deque()).append(task)
        self.wake()

    def discard_queued(self, source_id: int) -> List[Task]:
        """*engine*, lock held: removes the source's tasks not yet sent to a worker; returns them."""
        removed = self._queue.remove_source(source_id)
        for index, queue in self._pinned.items():
            mine = [t for t in queue if t.source_id == source_id]
            if mine:
                removed += mine
                self._pinned[index] = deque(t for t in queue if t.source_id != source_id)
        if self._state is PoolState.RUNNING:
            taken = self._backend.take_back(source_id)
            for task in taken:
                for load in self._loads:
                    load.outstanding.pop(task.ticket, None)
                    load.pinned.discard(task.ticket)
            removed += taken
        return removed

    def add_slot(self, source_id: int, slot_id: int, region_fd: int, overflow_fds: Sequence[int]) -> None:
        """*engine*, lock held: every worker may write into a new slot (descriptors are duplicated).

        Raises :class:`~extsrc.errors.SharedMemoryError` naming the limit when
        the process is out of descriptors; then no worker is told of the slot.
        """
        if self._state is not PoolState.RUNNING:
            return
        try:
            self._backend.add_slot(source_id, slot_id, region_fd, overflow_fds)
        except OSError as exc:
            if exc.errno not in DESCRIPTOR_ERRNOS:
                raise
            raise out_of_descriptors(
                exc, f"shared memory of source {self._source_name(source_id)}, slot {slot_id}") from None
        self.wake()

    def drop_slot(self, source_id: int, slot_id: int) -> None:
        """*engine*, lock held: tells every worker to drop a slot."""
        if self._state is not PoolState.RUNNING:
            return
        self._backend.drop_slot(source_id, slot_id)
        self.wake()

    def wake(self, _ident: Callable[[], int] = threading.get_ident) -> None:
        """*engine*, any thread, any time: makes the I/O thread run its loop once more. Also
        at interpreter exit, from a source's collection after the modules' names were cleared
        (``_ident`` is bound here for that)."""
        waker = self._waker
        if waker is not None and _ident() != self._io_ident:
            waker.wake()

    def running_tasks(self, source_id: int) -> List[Tuple[int, str, Task, float]]:
        """*engine*, lock held: ``(worker index, the worker described, task, seconds running)``
        of the source's sent tasks."""
        now = time.monotonic()
        rows = []
        for load in self._loads:
            for position, task in enumerate(load.outstanding.values()):
                if task.source_id == source_id:
                    running = now - load.busy_since if position == 0 else 0.0
                    rows.append((load.index, self._backend.describe_worker(load.index), task, running))
        return rows

    def other_work(self, source_id: int) -> List[str]:
        """*engine*, lock held: what keeps the workers from a source's tasks, one line per
        worker holding other sources' tasks (``"worker 0 (pid 12): 8 tasks of source a, the
        first running for 1.6 s"``)."""
        now = time.monotonic()
        lines = []
        for load in self._loads:
            others = [task for task in load.outstanding.values() if task.source_id != source_id]
            if not others:
                continue
            counts = collections.Counter(task.source_id for task in others)
            held = ", ".join(f"{n} task(s) of source {self._source_name(sid)}" for sid, n in counts.items())
            lines.append(f"{self._backend.describe_worker(load.index)}: {held}, the first running for "
                         f"{now - load.busy_since:.1f} s")
        return lines

    def _source_name(self, source_id: int) -> str:
        client = self._clients[source_id]() if 0 <= source_id < len(self._clients) else None
        return client.name if client is not None else f"#{source_id}"

    # -- the I/O thread -------------------------------------------------------------------------

    def _run(self, token: object) -> None:
        with self.lock:  # held by start() until it committed this thread, or gave up
            if self._io_token is not token:
                return  # an interrupted start's: the workers were stopped by start() itself
        self._io_ident = threading.get_ident()
        try:
            while self._io_round():
                pass
        except BaseException as exc:  # a bug, or no memory left: the pool must not hang its consumers
            with self.lock:
                try:
                    error: BaseException = InternalError(
                        f"the extsrc pool's I/O thread failed: {type(exc).__name__}: {exc}")
                    error.__cause__ = exc
                except BaseException:  # no memory for the message: the error made in advance
                    error = self._io_failed
                self._break(error)
        finally:
            try:
                self._backend.stop(ask=self._state is PoolState.CLOSED)
            finally:  # whatever stop() raised, the consumers waiting are told
                with self.lock:
                    if self._state is PoolState.RUNNING:  # _break() above failed too
                        self._state, self._error = PoolState.BROKEN, self._io_failed
                    self._loads = []
                    self.notify()
                if self._waker is not None:
                    self._waker.close()  # the loop polls it no more; a later wake() does nothing

    def _service_clients(self) -> Tuple[bool, bool, bool]:
        """I/O thread, lock held: lets every source dispatch and take back memory. Whether any
        changed what its consumers wait for, whether any lends batches out (then returned
        memory must be looked for every RETURN_POLL_S), and whether any source is left."""
        changed = lending = left = False
        for ref in self._clients:
            client = ref()
            if client is not None:
                left = True
                changed = client.service() or changed
                lending = lending or client.lends()
        return changed, lending, left

    def _io_round(self) -> bool:
        """One round: service, assign, send, wait, receive, deliver. False when the pool stops
        running."""
        backend = self._backend
        with self.lock:
            if self._state is not PoolState.RUNNING:
                return False
            changed, lending, left = self._service_clients()
            if self._clients and not left:
                # Every source was collected: nobody can use the workers again (see the module
                # doc). _run stops them as for close().
                self._state = PoolState.CLOSED
                self._error = PoolClosedError("every source of the pool was collected")
                self.notify()
                return False
            # Consumers are woken for what the last round delivered only now, right before this
            # thread lets go of the GIL in wait(): woken sooner, they would wait for it.
            changed, self._delivered = changed or self._delivered, False
            self._assign()
            covered = bool(self._loads) and all(self._covered(load) for load in self._loads)
            fault = backend.flush()
            while fault is not None:  # a worker replaced: its tasks and slots go to the new one
                if not self._fault(fault):
                    return False
                self._assign()
                fault = backend.flush()
            period = backend.poll_period()
            woken = self._take_waiters() if changed else []
        for waiter in woken:
            waiter.release()
        if covered is not self._io_defers:
            self._io_defers = covered
            defer_on_wake_up(covered)
        timeout = RETURN_POLL_S if lending else None
        if period is not None:
            timeout = period if timeout is None else min(timeout, period)
        # Waiting and receiving (which may copy samples into slots) run without the lock.
        received = backend.receive(backend.wait(timeout))
        with self.lock:
            if self._state is not PoolState.RUNNING:
                return False
            changed = False
            for arrival in received.arrivals:
                changed = self._deliver(arrival) or changed
            if received.fault is not None and not self._fault(received.fault):
                return False
            if period is not None:
                fault = backend.check()
                if fault is not None and not self._fault(fault):
                    return False
            self._delivered = changed  # its consumers are woken at the next round's wait
        return True

    def _deliver(self, arrival: Arrival) -> bool:
        """Lock held: hands a task's answer to its source; whether a consumer may now go on. An
        answer to no task the worker holds (a backend's bug) breaks the pool at once: nothing
        would ever answer the task it was meant for."""
        loads = self._loads
        load = loads[arrival.worker] if 0 <= arrival.worker < len(loads) else None
        task = None if load is None else load.outstanding.pop(arrival.ticket, None)
        if load is not None:
            load.pinned.discard(arrival.ticket)
        if load is None or task is None or task.source_id != arrival.source_id:
            self._break(InternalError(
                f"the {self.backend!r} backend answered ticket {arrival.ticket} of source "
                f"{arrival.source_id} for worker {arrival.worker}, and that worker holds no such "
                f"task (it holds tickets {sorted(load.outstanding) if load else []} of "
                f"{self.num_workers} workers): a bug of the backend, whose answers must name a "
                "task it was given. The workers were shut down."))
            return True
        load.busy_since = time.monotonic()  # the next task it holds runs (or waits) since
        if arrival.result is None:
            return False  # its slot is gone: the source was closed
        busy_ns = getattr(arrival.result, "busy_ns", 0)
        if busy_ns > 0:  # not a failed task, nor a backend that does not time its tasks
            timed = self._task_times.get(arrival.source_id)
            if timed is None:
                timed = self._task_times[arrival.source_id] = _TaskTime(self._backend.max_outstanding)
            timed.note(busy_ns)
        client = self._clients[arrival.source_id]()
        return client is not None and client.on_result(arrival.result)

    def _may_hold(self, level: int, task: Task) -> bool:
        """Lock held: whether a worker holding ``level - 1`` tasks may take ``task`` too."""
        return level <= self._depth(task.source_id)

    def _depth(self, source_id: int) -> int:
        """Lock held: how many of the source's tasks a worker may hold (see :class:`_TaskTime`)."""
        timed = self._task_times.get(source_id)
        return self._backend.max_outstanding if timed is None else timed.depth

    def has_idle_worker(self) -> bool:
        """*engine*, lock held: whether a worker holds no task now (an answer of another's
        will not come soon when that one's task turned out slow)."""
        return any(not load.outstanding for load in self._loads)

    def task_seconds(self, source_id: int) -> float:
        """*engine*, lock held: how long the source's tasks take a worker (a moving average;
        0.0: none timed yet)."""
        timed = self._task_times.get(source_id)
        return 0.0 if timed is None else timed.seconds

    def tasks_short(self, source_id: int) -> bool:
        """*engine*, lock held: whether the source's tasks are short (a worker may hold more
        than ``max_outstanding`` of them), as timed so far."""
        return self._depth(source_id) > self._backend.max_outstanding

    def _covered(self, load: _Load) -> bool:
        """Lock held: whether the worker holds only short tasks, and enough of them that the
        I/O thread may defer on wake-up (:func:`extsrc.engine.policy.defer_wake_ups`)."""
        held = len(load.outstanding)
        base = self._backend.max_outstanding
        if held <= base:
            return False
        depth = min(self._depth(task.source_id) for task in load.outstanding.values())
        return policy.defer_wake_ups(held, depth, base, self._io_defers)

    def _assign(self) -> None:
        if not self._queue and not any(self._pinned.values()):
            return
        deepest = max([self._backend.max_outstanding] + [t.depth for t in self._task_times.values()])
        for level in range(1, deepest + 1):
            for load in self._loads:
                if len(load.outstanding) >= level:
                    continue
                pinned = self._pinned.get(load.index)
                if pinned:
                    if level > self._depth(pinned[0].source_id):
                        continue  # a long task waits here rather than deep in a worker's queue
                    task = pinned.popleft()
                else:
                    found = self._queue.take(functools.partial(self._may_hold, level))
                    if found is None:
                        continue
                    task = found
                if not load.outstanding:
                    load.busy_since = time.monotonic()
                load.outstanding[task.ticket] = task
                if pinned:
                    load.pinned.add(task.ticket)
                self._backend.assign(load.index, task)

    def _held(self, worker: int) -> str:
        """Lock held: what ``worker`` held, for an error message."""
        held = []
        for task in self._loads[worker].outstanding.values() if worker < len(self._loads) else ():
            client = self._clients[task.source_id]()
            held.append(client.describe_task(task) if client is not None else f"a task of source {task.source_id}")
        return "; ".join(held) if held else "no samples"

    def _fault(self, fault: Fault) -> bool:
        """Lock held: the backend found a fault: a lost worker is replaced within
        ``worker_restarts``, else the pool breaks with the fault's error. Whether it goes on."""
        if self._state is not PoolState.RUNNING:
            return False
        if isinstance(fault, Lost) and self._replace(fault):
            return True
        error = fault(self._held)
        if isinstance(fault, Lost) and self.spec.worker_restarts and hasattr(error, "add_note"):
            error.add_note(f"(extsrc: the pool replaced {len(self.restarts)} lost worker(s) "
                           f"before, worker_restarts={self.spec.worker_restarts})")
        self._break(error)
        return False

    def _replace(self, lost: Lost) -> bool:
        """Lock held, I/O thread: starts a worker in the place of a lost one, which gets its
        tasks again (first in their queues, so the order of batches is kept); whether it did
        (within ``worker_restarts``, every source able to redo a task elsewhere)."""
        if len(self.restarts) >= self.spec.worker_restarts or not all(
                client.redoable for client in (ref() for ref in self._clients) if client is not None):
            return False
        what = str(lost(self._held)).replace(" The remaining workers were shut down.", "")
        replace = getattr(self._backend, "replace", None)  # a third party's backend may lack it
        try:
            if replace is None or not replace(lost.worker):
                return False
        except Exception as exc:
            _log.warning("extsrc: %s; no worker could be started in its place: %r", what, exc)
            return False
        load = self._loads[lost.worker]
        tasks = list(load.outstanding.values())
        self._queue.put_back(t for t in tasks if t.ticket not in load.pinned)
        self._pinned.setdefault(lost.worker, deque()).extendleft(
            reversed([t for t in tasks if t.ticket in load.pinned]))
        load.outstanding.clear()
        load.pinned.clear()
        load.busy_since = time.monotonic()
        self.restarts.append(what)
        _log.warning("extsrc: %s; a new worker took its place and its tasks (restart %d of "
                     "worker_restarts=%d)", what, len(self.restarts), self.spec.worker_restarts)
        return True

    def _break(self, error: BaseException) -> None:
        if self._state in (PoolState.BROKEN, PoolState.CLOSED):
            return
        self._state = PoolState.BROKEN
        self._error = error
        self.notify()
        self.wake()


def _waking(pool: "weakref.ReferenceType[WorkerPool]") -> Callable[["weakref.ReferenceType[PoolClient]"], None]:
    """The callback of a pool's references to its sources: a source collected wakes the I/O
    thread, which then looks whether any is left. It holds the pool weakly (no cycle)."""
    def client_gone(_reference: "weakref.ReferenceType[PoolClient]") -> None:
        live = pool()
        if live is not None:
            live.wake()
    return client_gone


_live_pools: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


def _close_live_pools() -> None:
    """At interpreter exit: the pools still open are closed, a Ctrl-C notwithstanding."""
    for pool in list(_live_pools):
        close_at_exit(pool.close)


atexit.register(_close_live_pools)
