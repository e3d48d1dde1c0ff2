"""The worker pool: start, schedule, receive, detect death, shut down.

One pool serves one or more sources. It knows tasks and workers, not epochs or
batches: a source submits :class:`~extsrc.messages.Task` s and is handed the
results through its ``_on_message``. Scheduling: every worker holds up to
``MAX_OUTSTANDING`` tasks (one running, one queued, so it never waits for the
parent); tasks go to the least loaded worker in the order they were
submitted, except tasks pinned to a worker (iterable sources, whose state
lives in one worker).

Death: each worker's process sentinel is watched together with its socket, so
a worker that dies (signal, OOM kill, ``os._exit``) is reported on the next
receive, naming the signal and the samples it held; the pool then shuts the
other workers down and refuses further use.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import weakref
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Protocol

from extsrc.cuda_state import FORK_AFTER_CUDA, cuda_initialized
from extsrc.errors import PoolClosedError, WorkerDiedError
from extsrc.messages import STOP, Task, TaskDone, TaskFailed, WorkerSetupFailed
from extsrc.pickling import Pickler
from extsrc.worker import SourceSpec, worker_main

START_METHODS = ("fork", "spawn", "forkserver")
MAX_OUTSTANDING = 2
_STOP_GRACE_S = 1.0

_live_pools: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


class PoolClient(Protocol):
    """What a source gives the pool (implemented by ``ParallelSource``)."""

    def _worker_spec(self, worker: int, payload: Optional[bytes]) -> SourceSpec: ...

    name: str

    def _pickle_target(self) -> Any: ...

    def _on_message(self, message: Any) -> None: ...

    def _release_memory(self) -> None: ...


class _Worker:
    def __init__(self, index: int, process, conn):
        self.index = index
        self.process = process
        self.conn = conn
        self.outstanding: Dict[int, Task] = {}  # ticket -> task, in submission order
        self.busy_since = time.monotonic()


class WorkerPool:
    """Worker processes shared by one or more :class:`~extsrc.ParallelSource` s.

    Create the pool, create the sources with ``pool=pool``, then ``start()``
    (or let the first iteration start it). Sources must exist before the pool
    starts, because workers receive all sources once, at start.

    ``start_method``: ``"fork"`` (fast; refused once CUDA is initialised),
    ``"spawn"`` or ``"forkserver"`` (sources are pickled with ``pickler``, see
    :class:`extsrc.pickling.Pickler`). ``close()`` stops the workers and frees
    the shared memory of every source; it is idempotent and also runs at
    interpreter exit.
    """

    def __init__(self, num_workers: int = 1, start_method: str = "fork", pickler: Any = None):
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        self.num_workers = num_workers
        self.start_method = start_method
        self.pickler = Pickler(pickler)
        self._clients: List[PoolClient] = []
        self._workers: List[_Worker] = []
        self._queue: Deque[Task] = deque()
        self._pinned: Dict[int, Deque[Task]] = {}
        self._pins = 0
        self._state = "new"
        self._error: Optional[BaseException] = None
        self._lock = threading.RLock()

    # -- life cycle -------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._state == "running"

    def _register(self, client: PoolClient) -> int:
        if self._state != "new":
            raise RuntimeError("sources must be added to a WorkerPool before it starts")
        self._clients.append(client)
        return len(self._clients) - 1

    def _pin(self) -> int:
        """A worker for a source whose state must stay in one process (round robin)."""
        worker = self._pins % self.num_workers
        self._pins += 1
        return worker

    def start(self) -> None:
        """Starts the workers; no-op if running. Raises if closed or broken."""
        with self._lock:
            if self._state == "running":
                return
            self._check_usable()
            if self.start_method == "fork" and cuda_initialized():
                raise RuntimeError(FORK_AFTER_CUDA)
            payloads: List[Optional[bytes]] = [None] * len(self._clients)
            if self.start_method != "fork":
                payloads = [
                    self.pickler.dumps(client._pickle_target(), what=f"source {client.name}")
                    for i, client in enumerate(self._clients)
                ]
            context = multiprocessing.get_context(self.start_method)
            self._state = "running"
            _live_pools.add(self)
            try:
                for index in range(self.num_workers):
                    self._start_worker(context, index, payloads)
            except BaseException:
                self.close()
                raise

    def _start_worker(self, context, index: int, payloads: List[Optional[bytes]]) -> None:
        parent_end, child_end = multiprocessing.Pipe(duplex=True)
        specs = [client._worker_spec(index, payloads[i]) for i, client in enumerate(self._clients)]
        inherited: List[int] = []
        if self.start_method == "fork":
            inherited = [w.conn.fileno() for w in self._workers] + [parent_end.fileno()]
        pickler = self.pickler if self.start_method != "fork" else None
        process = context.Process(
            target=worker_main,
            args=(index, child_end, specs, pickler, inherited),
            name=f"extsrc-worker-{index}",
            daemon=True,
        )
        process.start()
        child_end.close()
        self._workers.append(_Worker(index, process, parent_end))

    def close(self) -> None:
        """Stops all workers (asking first, then SIGTERM, then SIGKILL) and frees memory."""
        with self._lock:
            if self._state == "closed":
                return
            was_broken = self._state == "broken"
            self._state = "closed"
            if self._error is None:
                self._error = PoolClosedError("the source was closed")
            self._stop_workers(ask=not was_broken)
            for client in self._clients:
                client._release_memory()
            _live_pools.discard(self)

    def _stop_workers(self, ask: bool) -> None:
        for worker in self._workers:
            if ask:
                try:
                    worker.conn.send_bytes(pickle.dumps(STOP))
                except OSError:
                    pass
            worker.conn.close()
        deadline = time.monotonic() + (_STOP_GRACE_S if ask else 0.0)
        for worker in self._workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [w.process for w in self._workers if w.process.exitcode is None]
            if not alive:
                break
            for process in alive:
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    pass
            for process in alive:
                process.join(_STOP_GRACE_S)
        for worker in self._workers:
            if worker.process.exitcode is not None:
                worker.process.close()
        self._workers = []

    def _break(self, error: BaseException) -> BaseException:
        """Shuts the pool down after a fault; later use raises ``error`` again."""
        self._state = "broken"
        self._error = error
        self.close()
        self._error = error
        return error

    def _check_usable(self) -> None:
        if self._state in ("closed", "broken"):
            error = self._error or PoolClosedError("the pool was closed")
            if isinstance(error, PoolClosedError):
                raise PoolClosedError(f"{error} (no batches can be taken after close())")
            raise PoolClosedError(
                f"the source's workers were shut down after an earlier error: "
                f"{type(error).__name__}: {error}"
            ) from error

    # -- scheduling -------------------------------------------------------------

    def submit(self, task: Task, worker: Optional[int] = None) -> None:
        """Queues ``task`` (for ``worker`` only, if given) and sends what can be sent."""
        self._check_usable()
        if worker is None:
            self._queue.append(task)
        else:
            self._pinned.setdefault(worker, deque()).append(task)
        self._dispatch()

    def _dispatch(self) -> None:
        for level in range(1, MAX_OUTSTANDING + 1):
            for worker in self._workers:
                if len(worker.outstanding) >= level:
                    continue
                pinned = self._pinned.get(worker.index)
                if pinned:
                    task = pinned.popleft()
                elif self._queue:
                    task = self._queue.popleft()
                else:
                    continue
                if not worker.outstanding:
                    worker.busy_since = time.monotonic()
                worker.outstanding[task.ticket] = task
                try:
                    worker.conn.send_bytes(pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL))
                except OSError:
                    raise self._worker_died(worker) from None

    def discard_queued(self, source_id: int) -> List[Task]:
        """Removes the source's tasks not yet sent to a worker; returns them."""
        removed = [t for t in self._queue if t.source_id == source_id]
        self._queue = deque(t for t in self._queue if t.source_id != source_id)
        for worker, queue in self._pinned.items():
            removed += [t for t in queue if t.source_id == source_id]
            self._pinned[worker] = deque(t for t in queue if t.source_id != source_id)
        return removed

    def running_tasks(self, source_id: int) -> List[tuple]:
        """``(worker index, pid, task, seconds running)`` of the source's tasks sent to workers."""
        now = time.monotonic()
        rows = []
        for worker in self._workers:
            for position, task in enumerate(worker.outstanding.values()):
                if task.source_id == source_id:
                    running = now - worker.busy_since if position == 0 else 0.0
                    rows.append((worker.index, worker.process.pid, task, running))
        return rows

    # -- receiving --------------------------------------------------------------

    def receive(self, timeout: Optional[float]) -> None:
        """Waits up to ``timeout`` seconds for results and hands them to their sources.

        Raises :class:`WorkerDiedError` when a worker died, and the error that
        broke the pool on any use after that.
        """
        self._check_usable()
        by_conn = {w.conn: w for w in self._workers}
        by_sentinel = {w.process.sentinel: w for w in self._workers}
        ready = multiprocessing.connection.wait(list(by_conn) + list(by_sentinel), timeout)
        dead = []
        for item in ready:
            if item in by_conn:
                worker = by_conn[item]
                if not self._drain(worker):
                    dead.append(worker)
            else:
                dead.append(by_sentinel[item])
        for worker in dead:
            self._drain(worker)  # results it sent before dying still count
            raise self._worker_died(worker)
        self._dispatch()

    def _drain(self, worker: _Worker) -> bool:
        """Reads every message waiting from ``worker``; False if its socket closed."""
        conn = worker.conn
        try:
            while conn.poll():
                self._route(worker, pickle.loads(conn.recv_bytes()))
        except (EOFError, OSError):
            return False
        return True

    def _route(self, worker: _Worker, message: Any) -> None:
        if isinstance(message, (TaskDone, TaskFailed)):
            worker.outstanding.pop(message.ticket, None)
            worker.busy_since = time.monotonic()
            self._clients[message.source_id]._on_message(message)
        elif isinstance(message, WorkerSetupFailed):
            raise self._break(
                RuntimeError(
                    f"worker {message.worker} could not load the sources: {message.message}\n"
                    f"Worker traceback:\n{message.traceback}"
                )
            )

    def _worker_died(self, worker: _Worker) -> BaseException:
        process = worker.process
        process.join(1.0)
        code = process.exitcode
        hint = ""
        if code is None:
            how = "closed its connection"
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"was killed by {name} (signal {-code})"
            if -code == signal.SIGKILL:
                hint = " SIGKILL often comes from the kernel's out-of-memory killer (see dmesg)."
            elif -code == signal.SIGBUS:
                hint = " SIGBUS usually means shared memory ran out."
        else:
            how = f"exited with code {code}"
            if code == 1 and self.start_method != "fork":
                how += (
                    " (with spawn/forkserver a worker fails like this when the main script "
                    "starts workers without an `if __name__ == '__main__':` guard, or cannot "
                    "import something; its stderr above says which)"
                )
        held = [self._describe_task(task) for task in worker.outstanding.values()]
        what = "; ".join(held) if held else "no samples"
        return self._break(
            WorkerDiedError(
                f"extsrc worker {worker.index} (pid {process.pid}) {how} while it held {what}."
                f"{hint} The remaining workers were shut down."
            )
        )

    def _describe_task(self, task: Task) -> str:
        client = self._clients[task.source_id]
        return client._describe_task(task)


def _close_live_pools() -> None:
    for pool in list(_live_pools):
        try:
            pool.close()
        except Exception:
            pass


atexit.register(_close_live_pools)
