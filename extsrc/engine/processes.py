"""The ``"processes"`` backend: worker processes on this host, one channel each.

Implements :class:`~extsrc.engine.backend.WorkerBackend` with the
processes of :mod:`extsrc.engine.workers`: a task or a slot is a message on
the worker's channel (a slot's descriptors travel with ``SCM_RIGHTS``), and
the I/O thread waits on every channel, every worker's sentinel and the
pool's waker with one ``poll``. Workers write samples into the slots
themselves and answer with :class:`~extsrc.engine.protocol.TaskDone`.
"""

from __future__ import annotations

import os
import select
import threading
import dataclasses
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Sequence, Tuple

from extsrc.engine import workers as worker_processes
from extsrc.engine import policy
from extsrc.engine.backend import Arrival, Fault, HeldBy, Lost, Received, Wakeable
from extsrc.engine.channel import OwnedFds
from extsrc.engine.cuda_state import FORK_AFTER_CUDA, cuda_initialized
from extsrc.engine.protocol import (
    AddSlot, DropSlot, SetupFailed, SourceSetup, Task, TaskDone, TaskFailed, ToWorker, WorkerSetup,
)
from extsrc.engine.workers import WorkerHandle
from extsrc.errors import ForkAfterCudaError, WorkerDiedError
from extsrc.engine.spec import START_METHODS
from extsrc.shm.limits import DESCRIPTOR_ERRNOS, check_descriptors, out_of_descriptors

if TYPE_CHECKING:
    from extsrc.engine.pickling import Pickler

# What the I/O thread's poll found: (descriptor, events) pairs.
Events = List[Tuple[int, int]]


def setup_failed(message: SetupFailed, kind: str = "extsrc worker") -> Fault:
    """The fault of a worker that could not load the sources (for any backend)."""
    return lambda held: RuntimeError(
        f"{kind} {message.worker} could not load the sources: {message.message}\n"
        f"Worker traceback:\n{message.traceback}"
    )


class ProcessBackend:
    """Worker processes started with ``start_method`` (see :mod:`extsrc.engine.workers`)."""

    name = "processes"
    max_outstanding = policy.MAX_OUTSTANDING
    local_processes = True
    concurrent_samples = True

    @staticmethod
    def check_options(start_method: object, options: object, names: Tuple[str, str, str],
                      unset: object) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
        if start_method is unset:
            start_method = "fork"
        if not isinstance(start_method, str) or start_method not in START_METHODS:
            raise ValueError(f"{names[1]} must be one of {START_METHODS}, got {start_method!r}")
        if options is not None:
            raise ValueError(f"{names[2]} is for {names[0]}='ray', got it with {names[0]}='processes'")
        return start_method, None

    def __init__(self, num_workers: int, start_method: Optional[str], pickler: Pickler,
                 options: Optional[Dict[str, Any]] = None):
        assert start_method is not None
        self.num_workers = num_workers
        self.start_method = start_method
        self.pickler = pickler
        self._workers: List[WorkerHandle] = []
        self._poller: Optional[select.poll] = None
        self._sockets: Dict[int, WorkerHandle] = {}
        self._sentinels: Dict[int, WorkerHandle] = {}
        self._waker: Optional[Wakeable] = None
        self._setups: List[WorkerSetup] = []  # how each worker was started, to start it again
        self._run_main = True
        # The live slots' descriptors (the sources' own, not duplicated): what a new worker
        # in the place of a lost one is sent.
        self._slots: Dict[Tuple[int, int], Tuple[int, Tuple[int, ...]]] = {}

    def start(self, sources: Tuple[SourceSetup, ...], waker: Wakeable) -> Optional[KeyboardInterrupt]:
        if self._workers:  # a start interrupted, and interrupted again while it was undone
            self.stop(ask=False)
        method = self.start_method
        if method == "fork" and cuda_initialized():
            raise ForkAfterCudaError(FORK_AFTER_CUDA)
        # PR_SET_PDEATHSIG follows the thread that forks; the main thread lives as long
        # as the process, any other may end sooner (then workers use a watchdog).
        main = threading.current_thread() is threading.main_thread()
        context = worker_processes.context_for(method)
        # The default pickler carries everything of __main__ by value: the workers need not
        # import the main script again (see extsrc.engine.workers._main_hidden).
        run_main = method == "fork" or not self.pickler.by_value_main
        pickler = None if method == "fork" else self.pickler
        check_descriptors(2 + self.num_workers * worker_processes.DESCRIPTORS_PER_WORKER
                          + worker_processes.DESCRIPTORS_TO_START_ONE,
                          f"starting {self.num_workers} workers")
        setups = [
            WorkerSetup(
                index=index,
                parent_pid=None if method == "forkserver" else os.getpid(),
                forked=method == "fork",
                die_with_parent=main or method == "forkserver",
                sources=sources,
                pickler=pickler,
            )
            for index in range(self.num_workers)
        ]
        self._setups, self._run_main = setups, run_main
        held: Optional[KeyboardInterrupt] = None
        try:
            if method == "forkserver":
                # On a thread of their own; an interrupt meanwhile is held, and returned for the
                # pool to raise once it started (see worker_processes.launch_on_a_thread).
                held = worker_processes.launch_on_a_thread(context, setups, run_main, self._workers)
            else:
                for setup in setups:
                    worker, interrupt = worker_processes.launch(context, setup, run_main)
                    self._workers.append(worker)
                    held = held or interrupt  # raised once the pool runs, as forkserver's
        except BaseException as exc:
            starting = len(self._workers)
            self.stop(ask=False)
            if isinstance(exc, OSError) and exc.errno in DESCRIPTOR_ERRNOS:
                raise out_of_descriptors(exc, f"starting worker {starting} of the pool", OSError) from exc
            raise
        self._waker = waker
        # One poll set for the life of the pool: the waker, each worker's socket and sentinel.
        self._poller = select.poll()
        self._poller.register(waker.fileno(), select.POLLIN)
        for worker in self._workers:
            self._watch(worker)
        return held

    def _watch(self, worker: WorkerHandle) -> None:
        assert self._poller is not None
        self._sockets[worker.channel.fileno()] = worker
        self._sentinels[worker.sentinel] = worker
        self._poller.register(worker.channel.fileno(), select.POLLIN)
        self._poller.register(worker.sentinel, select.POLLIN)

    def replace(self, worker: int) -> bool:
        if self._poller is None or not 0 <= worker < len(self._workers):
            return False
        if self.start_method == "fork" and cuda_initialized():
            raise ForkAfterCudaError(FORK_AFTER_CUDA)
        lost = self._workers[worker]
        for fd in (lost.channel.fileno(), lost.sentinel):
            self._poller.unregister(fd)
        self._sockets.pop(lost.channel.fileno(), None)
        self._sentinels.pop(lost.sentinel, None)
        worker_processes.stop([lost], ask=False)  # reaped; its unsent messages dropped
        # Started from the I/O thread, which may end before the process: a watchdog then.
        setup = dataclasses.replace(self._setups[worker], die_with_parent=self.start_method == "forkserver")
        context = worker_processes.context_for(self.start_method)
        new, _ = worker_processes.launch(context, setup, self._run_main)  # I/O thread: none held
        self._workers[worker] = new
        self._watch(new)
        from extsrc.shm.segment import backend

        kind = backend()
        for (source_id, slot_id), (region_fd, overflow_fds) in self._slots.items():
            new.outbox.append((AddSlot(source_id, slot_id, kind),
                               OwnedFds((region_fd, overflow_fds[worker]))))
        return True

    # -- slots and tasks (lock held) ----------------------------------------------------------

    def add_slot(self, source_id: int, slot_id: int, region_fd: int, overflow_fds: Sequence[int]) -> None:
        from extsrc.shm.segment import backend

        kind = backend()
        duplicates: List[OwnedFds] = []
        try:
            for worker in self._workers:
                duplicates.append(OwnedFds((region_fd, overflow_fds[worker.index])))
        except BaseException:
            for fds in duplicates:
                fds.close()
            raise
        for worker, fds in zip(self._workers, duplicates):
            worker.outbox.append((AddSlot(source_id, slot_id, kind), fds))
        self._slots[(source_id, slot_id)] = (region_fd, tuple(overflow_fds))

    def drop_slot(self, source_id: int, slot_id: int) -> None:
        self._slots.pop((source_id, slot_id), None)
        for worker in self._workers:
            worker.outbox.append((DropSlot(source_id, slot_id), None))

    def assign(self, worker: int, task: Task) -> None:
        self._workers[worker].outbox.append((task, None))

    def take_back(self, source_id: int) -> List[Task]:
        removed: List[Task] = []
        for worker in self._workers:
            kept: Deque[Tuple[ToWorker, Optional[OwnedFds]]] = deque()
            for message, fds in worker.outbox:
                if isinstance(message, Task) and message.source_id == source_id:
                    removed.append(message)
                else:
                    kept.append((message, fds))
            worker.outbox = kept
        return removed

    def flush(self) -> Optional[Fault]:
        for worker in self._workers:
            outbox = worker.outbox
            while outbox:
                message, fds = outbox[0]
                plain = 1  # messages without descriptors from the front: one write for them all
                while fds is None and plain < len(outbox) and outbox[plain][1] is None:
                    plain += 1
                try:
                    if fds is not None:
                        worker.channel.send(message, fds.fds)
                    else:
                        worker.channel.send_many([outbox[k][0] for k in range(plain)])
                except OSError:
                    # A worker that could not load the sources says why, then exits: its
                    # reason must win over the broken pipe it leaves.
                    return self._receive(worker, []) or self._died(worker)
                if fds is not None:
                    outbox.popleft()
                    fds.close()
                else:
                    for _ in range(plain):
                        outbox.popleft()
        return None

    # -- the I/O thread, no lock --------------------------------------------------------------

    def wait(self, timeout: Optional[float]) -> Events:
        poller = self._poller
        assert poller is not None, "wait() after stop()"
        return poller.poll(None if timeout is None else timeout * 1000)

    def receive(self, events: Events) -> Received:
        arrivals: List[Arrival] = []
        woken = False
        for fd, _event in events:
            woken = True
            if self._waker is not None and fd == self._waker.fileno():
                self._waker.drain()
            elif fd in self._sockets:
                worker = self._sockets[fd]
                fault = self._receive(worker, arrivals)
                if fault is not None:
                    return Received(tuple(arrivals), fault, True)
            elif fd in self._sentinels:
                worker = self._sentinels[fd]
                fault = self._receive(worker, arrivals)  # what it sent before it ended still counts
                return Received(tuple(arrivals), fault or self._died(worker), True)
        return Received(tuple(arrivals), None, woken)

    def _receive(self, worker: WorkerHandle, arrivals: List[Arrival]) -> Optional[Fault]:
        try:
            messages = worker.channel.recv_available()
        except (EOFError, OSError):
            return self._died(worker)
        for message in messages:
            if isinstance(message, (TaskDone, TaskFailed)):
                arrivals.append(Arrival(worker.index, message.ticket, message.source_id, message))
            elif isinstance(message, SetupFailed):
                return setup_failed(message)
        return None

    def _died(self, worker: WorkerHandle) -> Lost:
        how, hint = worker_processes.describe_exit(worker, self.start_method)
        code = worker.process.exitcode  # read by describe_exit() already
        killed_by = -code if code is not None and code < 0 else None

        def error(held: HeldBy) -> BaseException:
            return WorkerDiedError(
                f"extsrc worker {worker.index} (pid {worker.pid}) {how} while it held "
                f"{held(worker.index)}.{hint} The remaining workers were shut down.",
                pid=worker.pid, signal=killed_by,
            )

        return Lost(worker.index, error)

    def poll_period(self) -> Optional[float]:
        return None

    def check(self) -> Optional[Fault]:
        return None

    # -- life cycle ---------------------------------------------------------------------------

    def stop(self, ask: bool) -> None:
        workers, self._workers = self._workers, []
        self._sockets, self._sentinels, self._poller = {}, {}, None
        worker_processes.stop(workers, ask=ask)

    def worker_pids(self) -> List[int]:
        return [w.pid for w in self._workers]

    def describe_worker(self, worker: int) -> str:
        return f"worker {worker} (pid {self._workers[worker].pid})" if worker < len(self._workers) \
            else f"worker {worker}"

    def forget_after_fork(self) -> None:
        for worker in self._workers:
            worker.channel.forget_after_fork()
        self._workers = []
        self._sockets, self._sentinels, self._poller = {}, {}, None
