"""A worker of the Ray backend: a Ray actor that runs the callbacks and returns the samples.

:class:`SourceActor` is what :class:`~extsrc.ray.RayBackend` makes remote. It
loads the sources once, like a worker process (they come pickled with the
pool's pickler), and runs tasks with the engine's
:class:`~extsrc.engine.runner.SourceRunner` with a writer sink of its own
(:class:`ActorWriter`, see :mod:`extsrc.engine.sink`): the same ``SampleInfo`` /
``BatchInfo`` / ``Order`` records, the same checks and the same errors. On
the consumer's node (``home``), it writes the samples straight into the
slot's shared memory with the engine's
:class:`~extsrc.shm.writer.TaskWriter`, as a worker process does: it opens
the slot's descriptors as ``/proc/<consumer pid>/fd/<n>``
(:class:`~extsrc.ray.protocol.SlotOpen`) and answers a
:class:`~extsrc.engine.protocol.TaskDone`. On another node (or for a slot
it could not open), it returns the samples, checked, as a
:class:`~extsrc.ray.protocol.Produced`, in Ray's reply or its object store
(see :mod:`extsrc.ray.parts`), and the pool writes them.

Ray runs an actor's calls one at a time in the order they were sent, and the
actor runs their tasks in that order, one at a time, which iterable sources
(whose state lives in one worker) rely on.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from extsrc.engine import (SAMPLE, Channel, SetupFailed, SourceRunner, SourceSetup, Task, TaskDone, load_source,
                           serve, slot_writer)
from extsrc.ray.parts import INLINE_MAX_BYTES, columns_bytes, fitting, split
from extsrc.ray.protocol import HELLO, ActorReady, ChannelOpened, Produced, SlotChange, SlotOpen

# Samples up to this size travel stacked, as one array per output: Ray serialises every array
# with some fixed cost (tens of microseconds), which dominates for small samples. Larger ones
# travel as they are: stacking them would copy the whole batch once more in the actor, for a
# per-array cost that is small next to their size.
STACK_MAX_SAMPLE_BYTES = 64 << 10
# A call answers once REPLY_TASKS tasks are done, or once one is and the next is not done
# REPLY_HOLD_S later. A Ray call costs about a millisecond of CPU between the pool, the actor
# and Ray's threads (on 2 cores, as much as running 256 samples of 1 KiB), so answering small
# tasks in pairs halves that; a task longer than the hold goes alone, where a call's cost does
# not matter, and a slow or stuck task holds back a finished one by no more than the hold.
REPLY_TASKS = 2
REPLY_HOLD_S = 0.005


class PackedWrite:
    """The samples of one task, checked and kept to be returned (what a worker process would
    write into shared memory). Same methods as :class:`extsrc.shm.writer.TaskWrite` that the
    runner calls: ``add`` a chunk of samples, ``direct_rows`` (none here), ``alloc`` room for
    an ``in_place`` callback (here a fresh array, returned with the others), ``describe`` a
    position."""

    def __init__(self, checker: Any, describe: Callable[[int], str]):
        self.checker = checker
        self.describe = describe
        # (position, count, packed columns, or their ObjectRef), none holding the callback's memory
        self.pieces: List[Tuple[int, int, Any]] = []
        self.nbytes = 0  # what the pieces weigh in transit (see extsrc.ray.parts.columns_bytes)

    def alloc(self, output: int, position: int, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self.checker.check(np.empty((0,) * len(shape), dtype), output, position, self.describe,
                           None, 0)
        return np.empty(shape, dtype)

    def direct_rows(self, sample: object, position: int) -> None:
        """No rows to write into: every sample goes through :meth:`add`."""
        return None

    def finish(self, give_back: bool = False) -> Tuple[Tuple[()], int]:
        """Nothing went to a slot's overflow: the samples are returned (:meth:`answer`)."""
        return (), 0

    def add(self, columns: List[Sequence[Any]], position: int, count: int) -> None:
        """Keeps samples ``position .. position + count - 1``, made independent of the callback's
        memory at once: the runner adds a task's large samples as they come, and the callback
        may refill the same buffer for the next one. A piece above
        :data:`~extsrc.ray.parts.INLINE_MAX_BYTES` that may be the callback's goes into Ray's
        object store (the one copy Ray would make of it anyway); a smaller one is copied;
        stacked samples are fresh already."""
        if not count:
            return
        packed = tuple(pack(self.checker, j, column, position, count, self.describe)
                       for j, column in enumerate(columns))
        borrowed = [isinstance(p, list) or (isinstance(c, np.ndarray) and np.may_share_memory(p, c))
                    for p, c in zip(packed, columns)]
        nbytes = columns_bytes(packed)
        self.nbytes += nbytes
        if any(borrowed) and nbytes > INLINE_MAX_BYTES:
            import ray

            self.pieces.append((position, count, ray.put(packed)))
            return
        packed = tuple(_copy(c) if b else c for c, b in zip(packed, borrowed))
        self.pieces.append((position, count, packed))

    def answer(self) -> Any:
        """The pieces: above :data:`~extsrc.ray.parts.INLINE_MAX_BYTES` put into Ray's object
        store and this is their ``ObjectRef`` (pieces in the store already are put as their
        ``ObjectRef`` s: the pool gets them in a second step), else the tuple itself."""
        pieces = tuple(self.pieces)
        if self.nbytes > INLINE_MAX_BYTES:
            import ray

            return ray.put(pieces)
        return pieces


class ActorWriter:
    """The writer sink (:mod:`extsrc.engine.sink`) an actor gives the engine's runner: a task
    whose slot this actor opened is written into it by ``slots`` (the engine's writer, as in a
    worker process) and answered with the engine's ``TaskDone``; any other is kept as a
    :class:`PackedWrite` and answered with a :class:`~extsrc.ray.protocol.Produced` (the pool
    writes it).

    Slots are added and dropped by Ray's call thread (:meth:`SourceActor.run`), tasks written by
    the runner thread: a slot is added before the tasks that use it are queued, and dropped
    only once every task for it has answered."""

    def __init__(self, setup: SourceSetup):
        self.slots = slot_writer(setup)
        self.checker = self.slots.checker
        self.kind = setup.kind

    def holds(self, slot_id: int) -> bool:
        return self.slots.holds(slot_id)

    def begin(self, slot_id: int, batch_seq: int, start: int, stop: int, region_bytes: int,
              regions: Any, describe: Callable[[int], str]) -> Any:
        if self.slots.holds(slot_id):
            return self.slots.begin(slot_id, batch_seq, start, stop, region_bytes, regions, describe)
        return PackedWrite(self.checker, describe)

    def answer(self, task: Task, write: Any, done: TaskDone) -> Any:
        """``done`` for a task written into its slot; else the samples themselves."""
        if not isinstance(write, PackedWrite):
            return done
        start = task.start if self.kind == SAMPLE else 0
        return Produced(task.source_id, task.ticket, start, done.samples, done.stopped, write.answer(),
                        done.busy_ns, done.timed, done.notes, done.faults)

    def add_slot(self, slot_id: int, region_fd: int, overflow_fd: int, kind: str, worker: int) -> None:
        """A slot whose descriptors came over the channel (see :meth:`SourceActor.serve`)."""
        self.slots.add_slot(slot_id, region_fd, overflow_fd, kind, worker)

    def drop_slot(self, slot_id: int) -> None:
        self.slots.drop_slot(slot_id)

    def close(self) -> None:
        self.slots.close()


def _copy(column: Any) -> Any:
    return np.array(column) if isinstance(column, np.ndarray) else [np.array(x) for x in column]


def pack(checker: Any, output: int, column: Sequence[Any], start: int, count: int,
         describe: Callable[[int], str]) -> Any:
    """Samples ``column[:count]`` of ``output``, checked as the writer would check them
    (:class:`~extsrc.engine.samples.SampleChecker`), as one array or a list of arrays.

    Raises :class:`~extsrc.errors.SampleError` naming the first bad sample.
    """
    if count == 0:
        return []
    first = checker.check(column[0], output, start, describe, None, 0)
    if isinstance(column, np.ndarray) and column.ndim == first.ndim + 1:
        return np.ascontiguousarray(column[:count])  # batch mode: every row is like the first
    shape, dtype = first.shape, first.dtype
    samples = list(column[:count])
    samples[0] = first
    same = all(s.__class__ is np.ndarray and s.shape == shape and s.dtype == dtype
               for s in samples[1:])
    if not same:
        for k in range(1, count):
            samples[k] = checker.check(samples[k], output, start + k, describe, first, start)
        same = all(s.shape == shape and s.dtype == dtype for s in samples)
    if same and first.nbytes <= STACK_MAX_SAMPLE_BYTES:
        return np.stack(samples, dtype=dtype)  # dtype given: its byte order kept
    return samples


class SourceActor:
    """One worker of a :class:`~extsrc.ray.RayBackend`, as a Ray actor (see the module docstring).

    ``sources`` are the pool's :class:`~extsrc.engine.protocol.SourceSetup` s,
    pickled with ``pickler``. A failure to load them is reported by every
    call (:class:`~extsrc.engine.protocol.SetupFailed`), not raised, so that
    the pool can say what went wrong.

    Tasks run in the actor's own thread (``extsrc-actor-runner``), one at a
    time, in the order they came; the pool's calls of :meth:`run` (Ray's
    thread, one call at a time) queue tasks and take the answers of those
    finished since the last call. A call answers as soon as a task is done,
    waiting at most :data:`REPLY_HOLD_S` more for the next one to finish
    too: the pool has at most one call out per actor, so what the actor
    holds keeps running while an answer travels, and a slow task never holds
    back a finished one by more than that.

    On the consumer's node the pool instead calls :meth:`serve` once, after
    :meth:`ready`: tasks and slots then come over a Unix socket and Ray's
    call thread runs them as a worker process does, answering on the socket
    as each ends (a message costs tens of microseconds, a Ray call about a
    millisecond), until the pool closes the channel.

    States of the runner thread: ``IDLE`` (no task queued) -> ``RUNNING``
    (one task) -> ``IDLE``; ``FAILED`` for good when running raised outside
    what the runner catches (a bug), which every later call raises.
    """

    def __init__(self, index: int, sources: Tuple[SourceSetup, ...], pickler: Any,
                 home: Optional[str] = None):
        self.index = index
        self.home = home  # the consumer's Ray node id: slots are opened only there
        self._local: Optional[bool] = None  # whether this actor runs on it (known at the first slot)
        self.runners: Dict[int, SourceRunner] = {}
        self.writers: Dict[int, ActorWriter] = {}
        self.setup_failed: Optional[SetupFailed] = None
        self._changed = threading.Condition()  # guards everything below
        self._queue: Deque[Task] = deque()  # received, not yet started
        self._running = False
        self._answers: List[Any] = []  # finished since the last call, in the order they ran
        self._failed: Optional[BaseException] = None
        try:
            for source in sources:
                callback, hooks = load_source(source, pickler)
                writer = self.writers[source.source_id] = ActorWriter(source)
                self.runners[source.source_id] = SourceRunner(source, callback, index, hooks, writer)
        except BaseException as exc:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self.setup_failed = SetupFailed(index, f"{type(exc).__name__}: {exc}", text)
            return
        threading.Thread(target=self._work, name="extsrc-actor-runner", daemon=True).start()

    def ready(self) -> Union[ActorReady, SetupFailed]:
        """Where this actor runs, once it has loaded the sources."""
        if self.setup_failed is not None:
            return self.setup_failed
        import ray

        context = ray.get_runtime_context()
        return ActorReady(self.index, context.get_actor_id() or "", context.get_node_id(),
                          str(ray.util.get_node_ip_address()), socket.gethostname(), os.getpid())

    def run(self, tasks: Tuple[Task, ...], parts: int = 0, slots: Tuple[SlotChange, ...] = ()) -> Any:
        """Applies ``slots`` (opened before this returns, so the pool may close its copies of
        the descriptors once it has the answer), then queues ``tasks`` behind those of earlier calls (see
        :meth:`extsrc.engine.runner.SourceRunner.run`) and answers with the
        tasks finished since the last call, in the order they ran: at least
        one, unless the actor holds none. One list, or with ``parts`` its
        ``1 + parts`` return values (see :func:`extsrc.ray.parts.split`).
        ``SetupFailed`` in place of the list when the sources could not be
        loaded; raises what broke the runner thread, if it broke."""
        if self.setup_failed is not None:
            answers: Any = self.setup_failed
            return (answers,) + (None,) * parts if parts else answers
        if slots:
            self._change_slots(slots)
        with self._changed:
            self._queue.extend(tasks)
            self._changed.notify_all()
            answers = self._take(parts)
        return split(answers, parts) if parts else answers

    def serve(self, address: str, token: bytes) -> ChannelOpened:
        """Connects to the pool's socket ``address`` (an abstract Unix socket of this host),
        says :data:`~extsrc.ray.protocol.HELLO` (``token``, its index), then handles the pool's
        messages until it closes the channel: tasks are run in this thread, in the order they
        come, each answered on the channel as it ends; slots are opened with the descriptors
        that came with them, or dropped. Answers ``ChannelOpened(False, why)`` at once when it
        cannot connect; raises what breaks running a task outside the callback (a bug)."""
        if self.setup_failed is not None:
            return ChannelOpened(False, self.setup_failed.message)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
            sock.sendall(HELLO.pack(token, self.index))
            channel = Channel(sock, pool_end=False)
        except OSError as exc:
            sock.close()
            return ChannelOpened(False, f"{type(exc).__name__}: {exc}")
        try:
            # Tasks run here, as in a worker process: no hand-over to the runner thread, which
            # has nothing queued (the pool makes no run() call to an actor it serves this way).
            serve(channel, self.runners, self.index)
        finally:
            sock.close()
        return ChannelOpened(True)

    def _change_slots(self, slots: Tuple[SlotChange, ...]) -> None:
        """Opens (on the consumer's node) or closes slots for the runners' writers. A slot that
        cannot be opened is left to the pool: the actor returns that slot's samples instead."""
        if self._local is None:
            self._local = self.home is not None and self.home == _node_id()
        for change in slots:
            actor_writer = self.writers.get(change.source_id)
            if actor_writer is None:
                continue
            writer = actor_writer.slots
            if not isinstance(change, SlotOpen):
                writer.drop_slot(change.slot_id)
                continue
            if not self._local:
                continue
            region = _open_of(change.pid, change.region_fd, change.region_file)
            overflow = _open_of(change.pid, change.overflow_fd, change.overflow_file)
            if region is None or overflow is None:
                for fd in (region, overflow):
                    if fd is not None:
                        os.close(fd)
                continue
            writer.add_slot(change.slot_id, region, overflow, change.kind, self.index)

    def _take(self, parts: int) -> List[Any]:
        """Lock held: the answers to hand over, once there are some (see :meth:`run`); with
        ``parts``, those that fit in them (see :func:`extsrc.ray.parts.fitting`)."""
        while not self._answers and self._holds() and self._failed is None:
            self._changed.wait()
        deadline = time.monotonic() + REPLY_HOLD_S
        while len(self._answers) < REPLY_TASKS and self._holds() and self._failed is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.wait(left)
        if self._failed is not None:
            raise self._failed
        count = fitting(self._answers, parts) if parts else len(self._answers)
        answers, self._answers = self._answers[:count], self._answers[count:]
        return answers

    def _holds(self) -> bool:
        """Lock held: whether a task is queued or running."""
        return self._running or bool(self._queue)

    def _work(self) -> None:
        """The runner thread: runs the queued tasks, one at a time, in order."""
        while True:
            with self._changed:
                while not self._queue:
                    self._changed.wait()
                task = self._queue.popleft()
                self._running = True
            try:
                answer = self.runners[task.source_id].run(task)
            except BaseException as exc:  # a bug outside the callback: every call says so
                with self._changed:
                    self._failed = exc
                    self._running = False
                    self._changed.notify_all()
                return
            with self._changed:
                self._answers.append(answer)
                self._running = False
                self._changed.notify_all()

    def ping(self) -> None:
        """Answers once the actor runs; after ``ray.kill``, the error says it is dead."""


def _open_of(pid: int, fd: int, file: Tuple[int, int]) -> Optional[int]:
    """Descriptor ``fd`` of process ``pid`` of this host, opened anew, if it is ``file``
    (``(st_dev, st_ino)``); else (gone, not allowed, another file) ``None``."""
    try:
        opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    stat = os.fstat(opened)
    if (stat.st_dev, stat.st_ino) != tuple(file):
        os.close(opened)
        return None
    return opened


def _node_id() -> str:
    """The id of the Ray node this process runs on."""
    import ray

    return ray.get_runtime_context().get_node_id()
