"""The Ray backend: the workers of a pool as Ray actors, anywhere in a cluster.

:class:`RayBackend` implements :class:`~extsrc.engine.backend.WorkerBackend`
(``WorkerPool(backend="ray")`` finds it by name). Everything a source sees
stays the pool's: the lock and waiters, the states and faults, the
scheduling (at most :data:`TASKS_PER_ACTOR` tasks per actor) and the I/O
thread. What differs is what a worker is and how results arrive:

* **Workers** are :class:`~extsrc.ray.actor.SourceActor` actors, created at
  ``start()`` with ``ray_options``, in the cluster this process is connected
  to (``ray.init()`` by the user), or in a local Ray started on first use.
  They receive the sources once, pickled with the pool's pickler, as
  ``spawn`` workers do.
* **Calls**: each actor has at most one call of ``run()`` out. It carries
  the tasks assigned to the actor since its last call (or none, when the
  actor still holds some) and answers with the tasks finished meanwhile,
  two at a time where the second follows closely (see
  :class:`~extsrc.ray.actor.SourceActor`): the actor keeps running what it
  holds while an answer travels, Ray's cost per call is shared by two
  batches, and a slow task never holds back a finished one.
* **Direct channel** (:data:`DIRECT_CHANNEL`): an actor on the consumer's node
  is asked, once it is ready, to ``serve()`` the pool over an abstract Unix
  socket the pool listens on (a process of this user that says the pool's
  token first, :data:`~extsrc.ray.protocol.HELLO`; nothing before is unpickled). From then on it is served as a
  worker process is: tasks, slots (``AddSlot`` with the descriptors, over
  ``SCM_RIGHTS``) and answers are the engine's messages on that socket, read
  by the I/O thread with the others; Ray's call thread stays in ``serve()``,
  whose failure (the actor killed, its node lost) is how Ray says why the
  actor is gone. Until an actor has said where it runs it gets Ray calls, as
  below; on this node, new tasks then wait until the tasks of its calls are
  answered and it has connected. One that cannot connect goes on with calls.
* **Slots**: an actor on the consumer's node writes the samples straight into
  the slot's shared memory, as a worker process does, with the engine's
  writer: each new slot goes to every actor not known to run elsewhere, in
  the next call (:class:`~extsrc.ray.protocol.SlotOpen`: the numbers of
  descriptors the pool duplicated and keeps open until that call has
  answered; the actor opens them as ``/proc/<pid>/fd/<n>``), and the actor
  answers an ordinary :class:`~extsrc.engine.protocol.TaskDone`. Only actors
  on other nodes (or set :data:`LOCAL_WRITES` to ``False``) return their
  samples through Ray, as follows.
* **Results** of the other actors come back in Ray's reply when small (cut into parts under
  Ray's inline limit, :mod:`extsrc.ray.parts`), else through its object
  store: the actor returns the checked samples
  (:class:`~extsrc.ray.protocol.Produced`), and the pool's I/O thread writes
  them into the slot (:class:`~extsrc.ray.writer.ResultWriter`) and hands the
  source an ordinary :class:`~extsrc.engine.protocol.TaskDone`.

Threads: the pool's I/O thread is the only one that calls Ray, apart from
``start()`` (which connects and creates the actors, in the thread calling
it, as the process backend starts its processes there). Each call's answer
is a list of ``ObjectRef`` s; the future of the last, once Ray has it, is
queued for the I/O thread and wakes it through the pool's waker; the I/O
thread waits on nothing but that waker (:meth:`RayBackend.wait`), so a
consumer's wake-up (a batch taken or dropped, ``close()``) is served at once
too. Results are written into the slots in :meth:`RayBackend.receive`,
without the pool's lock: only the I/O thread touches the writers' memory,
and a dropped slot is unmapped by it, between writes.

Faults: an actor that dies (``ray.kill``, a crash in native code, its node
lost) fails its calls with Ray's ``RayActorError``; within the pool's
``worker_restarts`` a new actor takes its place (:meth:`RayBackend.replace`),
else the pool raises :class:`~extsrc.errors.WorkerDiedError` naming the
actor, its node and the samples it held, and kills the other actors. A callback's exception comes
back like a worker process's. ``close()`` kills the actors, waits until Ray
reports them dead, and drops every reference to their results, so the object
store can free them. If Ray goes away (``ray.shutdown()``, the connection to
the cluster lost), the I/O thread notices within :data:`LIVENESS_PERIOD_S`
and breaks the pool: nothing waits for answers that cannot come.
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from extsrc.engine import (AddSlot, Arrival, Channel, DropSlot, Fault, HeldBy, InternalError, Lost, OwnedFds,
                           Received, SetupFailed, SourceSetup, Task, TaskDone, TaskFailed, Wakeable,
                           WorkerDiedError, setup_failed, shm_backend)
from extsrc.ray.options import check_options
from extsrc.ray.actor import REPLY_TASKS, SourceActor
from extsrc.ray.parts import columns_bytes, join, parts_for
from extsrc.ray.protocol import (HELLO, TOKEN_BYTES, ActorReady, ChannelOpened, Produced, SlotChange,
                                 SlotClose, SlotOpen)
from extsrc.ray.writer import ResultWriter

# While calls are out, the I/O thread checks at least this often that Ray is still connected:
# calls to a cluster that went away never answer, so their absence must be noticed.
LIVENESS_PERIOD_S = 1.0
# Ray starts an actor within seconds once a node has room for it; setting up a runtime_env
# (pip packages, a working_dir upload) can take minutes. An actor not running after this long
# waits for resources no node has: an error that says so beats waiting for ever.
ACTOR_START_TIMEOUT_S = 300.0
# close() waits this long for Ray to report killed actors dead (it takes milliseconds), so
# that their CPUs are free for whatever comes next.
ACTOR_STOP_WAIT_S = 10.0
PROCESS_EXIT_POLL_S = 0.01  # how often close() looks whether a killed actor's process is gone
# Tasks an actor holds at most (queued, running, or done and not yet answered). A call answers
# up to REPLY_TASKS of them (see extsrc.ray.actor); the others keep the actor busy while the
# answer travels back and the next call, with the next tasks, comes (3 gave fewer small batches
# per second in short runs on 2 cores: the actor then idled while answers travelled).
TASKS_PER_ACTOR = 4
# The return values of a call come in one reply: once the last is there, the others are, or
# follow within moments. A get of them that takes longer than this means Ray went away.
REPLY_GET_TIMEOUT_S = 10.0
# A large answer the actor put into the object store may have to come over the network: 64 MiB
# at 1 Gb/s take half a second. One that takes longer than this is lost with its node.
OBJECT_GET_TIMEOUT_S = 120.0
# What the pool's actors ask for unless ray_options says otherwise: a CPU each (Ray's default
# for actors is none while running, which would pile any number onto one node), spread over
# the nodes.
DEFAULT_ACTOR_OPTIONS = {"num_cpus": 1, "scheduling_strategy": "SPREAD"}
# Whether actors on the consumer's node write samples into the slots themselves (else every
# actor returns them through Ray); False is the path of actors on other nodes, on one node.
LOCAL_WRITES = True
# Whether actors on the consumer's node (with LOCAL_WRITES) get their tasks and slots, and
# answer, over a Unix socket as worker processes do, rather than in Ray calls: a Ray call costs
# about a millisecond of CPU between this process, the actor and Ray's threads, a message tens
# of microseconds (small samples: 0.43x the process backend's rate with calls on 2 cores).
DIRECT_CHANNEL = True
# An actor sends its HELLO right after it connects; a connection that says nothing for
# this long is not one of the pool's actors.
HELLO_TIMEOUT_S = 5.0
# When an actor's channel closes, Ray's own error for its serve() call (which says why: killed,
# its node lost) is waited for this long before the pool reports the actor lost without it.
CHANNEL_LOST_GRACE_S = 5.0
# Ray's words when an actor's owner, this process's Ray worker, went away (ray.shutdown() here).
OWNER_GONE = "Owner's worker process has crashed"
# What the pool's contract needs of its actors (see extsrc.ray.options.RAY_OPTIONS_OWNED).
FIXED_ACTOR_OPTIONS = {"max_restarts": 0, "max_task_retries": 0, "max_concurrency": 1}


def import_ray() -> Any:
    """The ``ray`` module, or ``ImportError`` saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            f"backend='ray' needs Ray, which cannot be imported here ({exc}); install it with "
            "pip install 'extsrc[ray]'"
        ) from None
    return ray


@dataclass(frozen=True)
class ActorInfo:
    """Where worker ``index`` of a :class:`RayBackend` runs, and how many samples it produced."""

    index: int
    actor_id: str
    node_id: str
    node_ip: str
    hostname: str
    pid: int
    samples: int
    direct_samples: int  # of them, written by the actor itself into the slots (its node is ours)
    channel: bool = False  # tasks and answers on a Unix socket to the pool, not in Ray calls


class _Lost(Exception):
    """A call's answer is Ray's error: the actor, its node or Ray itself is gone."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class ActorHandle:
    """One actor as the pool sees it (the counterpart of a worker process's handle)."""

    def __init__(self, index: int, actor: Any):
        self.index = index
        self.actor = actor
        self.started_at = time.monotonic()  # asked of Ray (at start(), or in a lost one's place)
        self.asked_by = "start()"  # what asked for it, for an error
        self.outbox: Deque[Task] = deque()  # assigned, not yet sent
        self.calls: Dict[int, List[Any]] = {}  # call id -> its ObjectRefs, until its answer is handled
        self.task_calls = 0  # calls of run() among them: 0 or 1
        self.sent: Dict[int, Task] = {}  # I/O thread: ticket -> task sent to the actor, not answered
        self.ready: Optional[ActorReady] = None
        self.samples = 0
        self.direct_samples = 0
        self.remote = False  # known to run on another node than the consumer's
        # Slots opened or closed since the last call, with the descriptors of each opened one,
        # which the pool keeps until the call that carried them answered (see SlotOpen).
        self.slot_changes: List[Tuple[SlotChange, Optional[OwnedFds]]] = []
        self.lent: Dict[int, List[OwnedFds]] = {}  # call id -> descriptors it carried
        # Direct channel (DIRECT_CHANNEL), once the actor said it runs on the consumer's node:
        # switching (its calls' tasks still out), asked to serve() and not connected yet;
        # the pool's end once connected, its messages not sent yet, and when it closed.
        self.switching = False  # to be asked to serve() once its tasks sent in calls are answered
        self.connecting = False
        self.channel: Optional[Channel] = None
        self.direct: Deque[Tuple[Any, Optional[OwnedFds]]] = deque()
        self.channel_lost_at: Optional[float] = None

    @property
    def pid(self) -> int:
        """The actor's pid on its node (0 until it has started)."""
        return self.ready.pid if self.ready is not None else 0

    def describe(self) -> str:
        ready = self.ready
        if ready is None:
            return f"extsrc ray worker {self.index} (a Ray actor that had not started yet)"
        return (f"extsrc ray worker {self.index} (Ray actor {ready.actor_id}, pid {ready.pid} on node "
                f"{ready.node_ip} ({ready.hostname}), node id {ready.node_id})")


class RayBackend:
    """The workers of a :class:`~extsrc.WorkerPool` as ``num_workers`` Ray actors.

    Made by ``WorkerPool(num_workers, backend="ray", ray_options=...)``,
    ``ParallelSource(..., pool=PoolSpec(backend="ray"))`` or ``pipeline_def(...,
    py_backend="ray")``; ``pool.workers_backend`` is this object. Sources on
    it behave as on worker processes: the same batches in the same order,
    zero-copy and valid for as long as they are held, the same errors (see
    the module docstring for what differs underneath). The actors run
    wherever Ray places them in the cluster this process is connected to
    (``ray.init(address=...)`` before ``start()``), or in a local Ray that
    ``start()`` starts when none is connected. ``ray_options`` go to every
    actor: ``num_cpus`` (default 1), ``num_gpus``, ``memory``,
    ``resources``, ``accelerator_type``, ``label_selector``,
    ``scheduling_strategy`` (default ``"SPREAD"``), ``runtime_env`` (e.g.
    ``{"py_modules": [...]}`` when the callback's modules are not installed
    on the nodes). extsrc itself must be importable on every node.

    ``worker_pids()`` are the actors' pids on their nodes; :meth:`actors`
    says which node each runs on. Stopping kills the actors and returns once
    Ray reports them dead. Raises ``ImportError`` when Ray is missing,
    ``ValueError`` for ``ray_options`` Ray refuses.

    Each actor holds up to :attr:`max_outstanding` tasks (a source's default
    ``prefetch`` is that many batches per worker), with one call out at a
    time that brings it new tasks and takes back the answers of finished
    ones (see :class:`~extsrc.ray.actor.SourceActor`).
    """

    name = "ray"
    max_outstanding = TASKS_PER_ACTOR
    local_processes = False  # the actors may run on other hosts: no /proc of theirs
    concurrent_samples = False  # an actor runs its samples one at a time
    check_options = staticmethod(check_options)

    def __init__(self, num_workers: int, start_method: Optional[str], pickler: Any,
                 options: Optional[Dict[str, Any]] = None):
        self.num_workers = num_workers
        self.pickler = pickler
        self._options = options
        ray = import_ray()
        merged = {**DEFAULT_ACTOR_OPTIONS, **(options or {}), **FIXED_ACTOR_OPTIONS}
        try:
            self._actor_class = ray.remote(SourceActor).options(**merged)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"ray_options={options!r}: Ray refused them: {exc}") from None
        self._workers: List[ActorHandle] = []
        self._writers: Dict[int, ResultWriter] = {}  # source id -> its writer
        # The sources, put in Ray's object store again for an actor started in a lost one's place
        # (no ObjectRef is kept: releasing one after ray.shutdown() ends the process).
        self._sources: Optional[Tuple[SourceSetup, ...]] = None
        # Live slots: (source id, slot id) -> (region fd, overflow fds), the pool's descriptors,
        # opened again by an actor started in a lost one's place.
        self._slots: Dict[Tuple[int, int], Tuple[int, Tuple[int, ...]]] = {}
        # Calls answered, queued by Ray's threads for the I/O thread: (worker, call, its
        # ObjectRefs, whether it ran tasks, the future of its last return value).
        self._arrivals: Deque[Tuple[ActorHandle, int, List[Any], bool, Any]] = deque()
        self._sample_bytes: Dict[int, float] = {}  # I/O thread: source id -> bytes per sample seen
        self._calls = itertools.count()
        self._started_at = 0.0
        self._waker: Optional[Wakeable] = None
        self._poller: Any = None
        self._home = ""  # the Ray node id of this process (the consumer's)
        # The abstract Unix socket local actors connect to (DIRECT_CHANNEL), and the token they
        # must say first.
        self._listener: Optional[socket.socket] = None
        self._address = ""
        self._token = b""

    @property
    def ray_options(self) -> Optional[Dict[str, Any]]:
        """The ``ray_options`` given (before the backend's defaults)."""
        return None if self._options is None else dict(self._options)

    def worker_pids(self) -> List[int]:
        """The pids of the actors that have started, each on its own node (empty after close)."""
        return [w.pid for w in list(self._workers) if w.ready is not None]

    def actors(self) -> List[ActorInfo]:
        """Where each started actor runs and how many samples it produced, in worker order."""
        return [ActorInfo(w.index, w.ready.actor_id, w.ready.node_id, w.ready.node_ip,
                          w.ready.hostname, w.ready.pid, w.samples, w.direct_samples,
                          w.channel is not None)
                for w in list(self._workers) if w.ready is not None]

    # -- life cycle -----------------------------------------------------------------------------

    def start(self, sources: Tuple[SourceSetup, ...], waker: Wakeable) -> None:
        """Creates the actors (pool's lock held, in the thread calling ``WorkerPool.start()``).

        Connects to Ray first if this process is not connected (``ray.init()``:
        the cluster named by ``RAY_ADDRESS`` or started on this host with
        ``ray start``, else a new local one, which lives until the process
        exits). Returns without waiting for the actors to run: tasks queue
        until they do.
        """
        pickler = self.pickler
        ray = import_ray()
        if not ray.is_initialized():
            _start_local_ray(ray)
        self._writers = {s.source_id: ResultWriter(s, self.num_workers) for s in sources}
        self._waker = waker
        self._started_at = time.monotonic()
        try:
            self._home = ray.get_runtime_context().get_node_id()
            home = self._home if LOCAL_WRITES else None
            shared = ray.put(sources)  # once for all actors
            self._sources = sources
            for index in range(self.num_workers):
                worker = ActorHandle(index, self._actor_class.remote(index, shared, pickler, home))
                self._workers.append(worker)
                self._watch(worker, False, [worker.actor.ready.remote()])
        except BaseException:
            self._kill(self._workers)
            self._workers = []
            self._writers = {}
            self._waker = None
            self._sources = None
            raise
        self._poller = select.poll()
        self._poller.register(waker.fileno(), select.POLLIN)
        if DIRECT_CHANNEL and LOCAL_WRITES:
            self._listen()

    def _listen(self) -> None:
        """Opens the socket local actors connect to: abstract (no file to leave behind), its
        name and the token unguessable. Without it (a host that refuses), actors get Ray calls."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = f"\0extsrc-ray-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            listener.bind(address)
            listener.listen(self.num_workers)
        except OSError:
            listener.close()
            return
        listener.setblocking(False)
        self._listener, self._address, self._token = listener, address, secrets.token_bytes(TOKEN_BYTES)
        self._poller.register(listener.fileno(), select.POLLIN)

    def stop(self, ask: bool) -> None:
        workers, self._workers = self._workers, []
        writers, self._writers = self._writers, {}
        self._sources = None
        self._slots.clear()
        self._kill(workers)
        self._arrivals.clear()  # the answers and the object-store memory they pin
        for writer in writers.values():
            writer.close()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def forget_after_fork(self) -> None:
        # In a forked child: the actors and the memory are the parent's. Their Ray objects are
        # kept, never released here: releasing one runs Ray's code, which needs the threads of
        # Ray that only the parent has.
        _kept_in_child.append((self._workers, self._arrivals))
        for worker in self._workers:
            if worker.channel is not None:
                worker.channel.forget_after_fork()
            for _, fds in worker.direct:
                if fds is not None:
                    fds.forget_after_fork()
        self._workers = []
        self._writers = {}
        self._arrivals = deque()
        self._sources = None
        self._slots = {}
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                os.close(listener.detach())
            except OSError:
                pass

    # -- slots and tasks (pool's lock held) -----------------------------------------------------

    def add_slot(self, source_id: int, slot_id: int, region_fd: int, overflow_fds: Sequence[int]) -> None:
        """The I/O thread writes into the slot for the actors (see
        :class:`~extsrc.ray.writer.ResultWriter`); the descriptors are duplicated."""
        writer = self._writers.get(source_id)
        if writer is None:
            return
        kind = shm_backend()
        lent: List[OwnedFds] = []
        try:
            for worker in self._workers:
                if not worker.remote and LOCAL_WRITES:
                    lent.append(OwnedFds((region_fd, overflow_fds[worker.index])))
            writer.add_slot(slot_id, region_fd, overflow_fds, kind)
        except BaseException:
            for fds in lent:
                fds.close()
            raise
        self._slots[(source_id, slot_id)] = (region_fd, tuple(overflow_fds))
        for worker, fds in zip((w for w in self._workers if not w.remote), lent):
            self._open_slot(worker, source_id, slot_id, kind, fds)

    def _open_slot(self, worker: ActorHandle, source_id: int, slot_id: int, kind: str, fds: OwnedFds) -> None:
        """Tells ``worker`` of a slot it may write into, lending it ``fds``."""
        if worker.channel is not None:
            worker.direct.append((AddSlot(source_id, slot_id, kind), fds))
            return
        region, overflow = fds.fds
        worker.slot_changes.append((SlotOpen(source_id, slot_id, kind, os.getpid(), region, overflow,
                                             _file_id(region), _file_id(overflow)), fds))

    def drop_slot(self, source_id: int, slot_id: int) -> None:
        """The slot's mappings go at the I/O thread's next round."""
        self._slots.pop((source_id, slot_id), None)
        writer = self._writers.get(source_id)
        if writer is not None:
            writer.drop_slot(slot_id)
            for worker in self._workers:
                if worker.channel is not None:
                    worker.direct.append((DropSlot(source_id, slot_id), None))
                elif not worker.remote and LOCAL_WRITES:
                    worker.slot_changes.append((SlotClose(source_id, slot_id), None))

    def assign(self, worker: int, task: Task) -> None:
        self._workers[worker].outbox.append(task)

    def take_back(self, source_id: int) -> List[Task]:
        removed: List[Task] = []
        for worker in self._workers:
            mine = [t for t in worker.outbox if t.source_id == source_id]
            if mine:
                removed += mine
                worker.outbox = deque(t for t in worker.outbox if t.source_id != source_id)
        return removed

    # -- calls and their answers ----------------------------------------------------------------

    def _watch(self, worker: ActorHandle, runs: bool, refs: List[Any]) -> int:
        """Queues the answer of a call (its return values ``refs``; ``runs``: a call of
        ``run()``, else of ``ready()``) for the I/O thread once Ray has it."""
        call = next(self._calls)
        worker.calls[call] = refs
        if runs:
            worker.task_calls += 1
        # One reply brings every return value: a callback on the last is enough.
        refs[-1].future().add_done_callback(functools.partial(self._arrived, worker, call, refs, runs))
        return call

    def _arrived(self, worker: ActorHandle, call: int, refs: List[Any], runs: bool, future: Any) -> None:
        # In a thread of Ray's (or the I/O thread): only queue and wake, nothing that can block.
        self._arrivals.append((worker, call, refs, runs, future))
        waker = self._waker
        if waker is not None:
            waker.wake()

    def flush(self) -> Optional[Fault]:
        """Sends each actor that has no call out the tasks assigned to it since its last call;
        one that holds tasks gets a call without new ones, which takes their answers."""
        ray = import_ray()
        for worker in self._workers:
            if worker.channel is not None:
                self._flush_direct(worker)
                continue
            if worker.connecting or (worker.switching and worker.task_calls):
                continue  # new tasks wait for the channel
            if worker.switching and not worker.sent:
                try:  # every task sent in a call is answered: from now on, the channel
                    _connected(ray)
                    refs = [worker.actor.serve.remote(self._address, self._token)]
                except Exception as exc:
                    return self._connection_lost(exc)
                worker.switching, worker.connecting = False, True
                self._watch(worker, False, refs)
                continue
            if worker.task_calls or not (worker.outbox or worker.sent or worker.slot_changes):
                continue
            tasks = () if worker.switching else tuple(worker.outbox)
            if not worker.switching:
                worker.outbox.clear()
            changes = tuple(change for change, _ in worker.slot_changes)
            lent = [fds for _, fds in worker.slot_changes if fds is not None]
            worker.slot_changes = []
            for task in tasks:
                worker.sent[task.ticket] = task
            # The answer carries up to REPLY_TASKS tasks, the first ones the actor holds.
            expected = sum((task.stop - task.start) * self._sample_bytes.get(task.source_id, 0.0)
                           for task in itertools.islice(worker.sent.values(), REPLY_TASKS))
            parts = parts_for(expected)
            try:
                _connected(ray)
                if parts:
                    refs = worker.actor.run.options(num_returns=1 + parts).remote(tasks, parts, changes)
                else:
                    refs = [worker.actor.run.remote(tasks, 0, changes)]
            except Exception as exc:
                for fds in lent:
                    fds.close()
                return self._connection_lost(exc)
            worker.lent[self._watch(worker, True, refs)] = lent
        return None

    def _flush_direct(self, worker: ActorHandle) -> None:
        """Sends ``worker``'s new tasks and slot changes on its channel. A channel that fails
        is lost (see :meth:`_channel_closed`); its tasks are then held by a lost actor."""
        channel = worker.channel
        assert channel is not None
        while worker.outbox:
            task = worker.outbox.popleft()
            worker.sent[task.ticket] = task
            worker.direct.append((task, None))
        while worker.direct and worker.channel_lost_at is None:
            message, fds = worker.direct[0]
            try:
                channel.send(message, fds.fds if fds is not None else ())
            except OSError:
                self._channel_closed(worker)
                return
            worker.direct.popleft()
            if fds is not None:
                fds.close()

    def _channel_closed(self, worker: ActorHandle) -> None:
        """The actor's channel closed (it died, or broke): Ray's error for its ``serve()`` call
        says why, and :meth:`check` reports the actor lost without it after
        :data:`CHANNEL_LOST_GRACE_S`."""
        if worker.channel_lost_at is None:
            worker.channel_lost_at = time.monotonic()
            if worker.channel is not None:
                self._poller.unregister(worker.channel.fileno())

    def _accept(self) -> None:
        """I/O thread: takes the connections of actors asked to serve(); each must say its
        index and the token first."""
        listener = self._listener
        while listener is not None:
            try:
                sock, _ = listener.accept()
            except OSError:  # none waiting (BlockingIOError), or the listener is closed
                return
            worker = self._hello(sock)
            if worker is None:
                sock.close()
                continue
            self._connected(worker, Channel(sock, pool_end=True))

    def _hello(self, sock: socket.socket) -> Optional[ActorHandle]:
        """The worker a new connection is, if it is a process of this user that says the
        pool's token and the index of a worker waiting to connect, and is that worker's process
        (not a lost actor of that index whose connection waited to be taken); nothing it sent
        before is unpickled."""
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
        if uid != os.getuid():
            return None
        sock.settimeout(HELLO_TIMEOUT_S)
        hello = bytearray()
        try:
            while len(hello) < HELLO.size:
                chunk = sock.recv(HELLO.size - len(hello))
                if not chunk:
                    return None
                hello += chunk
        except OSError:
            return None
        token, index = HELLO.unpack(hello)
        if not secrets.compare_digest(token, self._token) or not 0 <= index < len(self._workers):
            return None
        worker = self._workers[index]
        if worker.ready is None or worker.ready.pid != pid:
            return None
        return worker if worker.connecting and worker.channel is None else None

    def _connected(self, worker: ActorHandle, channel: Channel) -> None:
        """``worker`` serves on ``channel`` from now on: the slot changes waiting for its first
        call go on the channel instead."""
        worker.channel = channel
        worker.connecting = False
        for change, fds in worker.slot_changes:
            if isinstance(change, SlotOpen):
                worker.direct.append((AddSlot(change.source_id, change.slot_id, change.kind), fds))
            else:
                worker.direct.append((DropSlot(change.source_id, change.slot_id), None))
        worker.slot_changes = []
        self._poller.register(channel.fileno(), select.POLLIN)

    def wait(self, timeout: Optional[float]) -> Any:
        if not self._arrivals:
            self._poller.poll(None if timeout is None else timeout * 1000)
        if self._waker is not None:
            self._waker.drain()
        return None

    def receive(self, events: Any) -> Received:
        """Writes what came into the slots (no lock: see the module docstring) and hands the
        pool the tasks' answers."""
        arrivals = []
        while self._arrivals:
            arrivals.append(self._arrivals.popleft())
        for writer in list(self._writers.values()):
            writer.apply_drops()
        delivered: List[Arrival] = []
        for k, (worker, call, refs, runs, future) in enumerate(arrivals):
            if not self._current(worker):
                continue  # a call of an actor replaced since: its tasks were given to the new one
            direct: Dict[int, bool] = {}  # ticket -> written by the actor itself
            answer = self._land(worker, refs, runs, future, direct)
            if isinstance(answer, _Lost):
                self._arrivals.extendleft(reversed(arrivals[k + 1:]))  # the others' answers stay
                return Received(tuple(delivered), self._actor_lost(worker, answer.error), True)
            if isinstance(answer, SetupFailed):
                return Received(tuple(delivered), setup_failed(answer, "extsrc ray worker"), True)
            worker.calls.pop(call, None)
            for fds in worker.lent.pop(call, ()):
                fds.close()  # the actor opened its own
            if isinstance(answer, ActorReady):
                worker.ready = answer
                worker.remote = answer.node_id != self._home
                worker.switching = self._listener is not None and not worker.remote
                continue
            if isinstance(answer, ChannelOpened):
                if not answer.connected:
                    worker.connecting = False  # Ray calls, then
                elif worker.channel is not None and worker.channel_lost_at is None:
                    self._channel_closed(worker)  # it ended serving, unasked
                continue
            worker.task_calls -= 1
            for task, result in answer:
                worker.sent.pop(task.ticket, None)
                if isinstance(result, TaskDone):
                    worker.samples += result.samples
                    if direct.get(task.ticket, False):
                        worker.direct_samples += result.samples
                delivered.append(Arrival(worker.index, task.ticket, task.source_id,
                                         result if isinstance(result, (TaskDone, TaskFailed)) else None))
        if any(w.connecting for w in self._workers):
            self._accept()
        for worker in self._workers:
            if worker.channel is None or worker.channel_lost_at is not None:
                continue
            try:
                messages = worker.channel.recv_available()
            except (EOFError, OSError):
                self._channel_closed(worker)
                continue
            for message in messages:
                if not isinstance(message, (TaskDone, TaskFailed)):
                    continue
                worker.sent.pop(message.ticket, None)
                if isinstance(message, TaskDone):
                    worker.samples += message.samples
                    worker.direct_samples += message.samples
                delivered.append(Arrival(worker.index, message.ticket, message.source_id, message))
        return Received(tuple(delivered), None, True)

    def _current(self, worker: ActorHandle) -> bool:
        """Whether ``worker`` is still the pool's worker of its index (not replaced)."""
        return worker.index < len(self._workers) and self._workers[worker.index] is worker

    def _land(self, worker: ActorHandle, refs: List[Any], runs: bool, future: Any,
              direct: Dict[int, bool]) -> Any:
        """I/O thread, no lock: a call's answer, with every ``Produced`` written into its slot,
        as ``(task, result)`` pairs (a ``TaskDone``, or ``TaskFailed`` if the memory could not
        be had; ``None`` if the slot is gone), or ``_Lost`` with Ray's error."""
        ray = import_ray()
        try:
            values = [future.result()]
            if len(refs) > 1:
                _connected(ray)
                values = ray.get(refs[:-1], timeout=REPLY_GET_TIMEOUT_S) + values
        except Exception as exc:  # Ray's error for the call: the actor, its node or Ray is gone
            return _Lost(exc)
        answer = values[0]
        if not runs or not isinstance(answer, list):
            return answer  # ready()'s answer, or SetupFailed
        if len(values) > 1:
            answer = join(answer, values[1:])
        stored = [k for k, result in enumerate(answer)
                  if isinstance(result, Produced) and not isinstance(result.pieces, tuple)]
        if stored:
            try:
                _connected(ray)
                got = ray.get([answer[k].pieces for k in stored], timeout=OBJECT_GET_TIMEOUT_S)
                # Pieces the actor stored as they came (see PackedWrite.add), in a second step.
                nested = [c for pieces in got for _, _, c in pieces if not isinstance(c, tuple)]
                fetched = iter(ray.get(nested, timeout=OBJECT_GET_TIMEOUT_S))
            except Exception as exc:  # the object's node lost, or Ray gone
                return _Lost(exc)
            for k, pieces in zip(stored, got):
                answer[k] = answer[k]._replace(pieces=tuple(
                    (position, count, c if isinstance(c, tuple) else next(fetched))
                    for position, count, c in pieces))
        landed = []
        for result in answer:
            task = worker.sent[result.ticket]
            direct[result.ticket] = isinstance(result, TaskDone)
            if isinstance(result, Produced):
                if result.count:
                    self._sample_bytes[task.source_id] = sum(
                        columns_bytes(columns) for _, _, columns in result.pieces) / result.count
                writer = self._writers.get(task.source_id)
                result = None if writer is None else writer.write(worker.index, task, result)
            landed.append((task, result))
        return landed

    def poll_period(self) -> Optional[float]:
        """While calls are out, Ray's connection is checked this often (see :meth:`check`)."""
        return LIVENESS_PERIOD_S if any(w.calls for w in self._workers) else None

    def check(self) -> Optional[Fault]:
        """Whether Ray is still connected and every actor started in time."""
        ray = import_ray()
        if not ray.is_initialized():
            return self._connection_lost(None)
        now = time.monotonic()
        for worker in self._workers:
            if worker.channel_lost_at is not None and now - worker.channel_lost_at > CHANNEL_LOST_GRACE_S:
                return self._channel_lost(worker)
        late = [w for w in self._workers if w.ready is None]
        oldest = min(late, key=lambda w: w.started_at) if late else None
        if oldest is not None and now - oldest.started_at > ACTOR_START_TIMEOUT_S:
            message = (
                f"extsrc ray worker {oldest.index} (of {len(late)} not started) was not running "
                f"{ACTOR_START_TIMEOUT_S:g} s after {oldest.asked_by}: no node of the cluster has room for an "
                f"actor with {self._asked()}. The cluster has {self._resources(ray)}. Lower "
                "num_workers, ask for less in ray_options, or add nodes."
            )
            return lambda held: RuntimeError(message)
        return None

    def replace(self, worker: int) -> bool:
        """Lock held, I/O thread: a new actor in the place of the lost ``worker``, wherever Ray
        places it (another node, if its node is gone), asked for with the same options and
        sources; it opens the live slots with its first call, and gets the lost one's tasks
        again from the pool. The lost actor is killed, its calls and lent descriptors dropped."""
        if self._poller is None or self._sources is None or not 0 <= worker < len(self._workers):
            return False
        lost = self._workers[worker]
        if lost.channel is not None and lost.channel_lost_at is None:
            self._poller.unregister(lost.channel.fileno())
        self._kill([lost])
        home = self._home if LOCAL_WRITES else None
        ray = import_ray()
        _connected(ray)  # not Ray's auto-init behind the user's back
        new = ActorHandle(worker, self._actor_class.remote(worker, ray.put(self._sources), self.pickler, home))
        new.asked_by = "it was asked for in a lost actor's place"
        self._workers[worker] = new
        self._watch(new, False, [new.actor.ready.remote()])
        if LOCAL_WRITES:
            kind = shm_backend()
            for (source_id, slot_id), (region_fd, overflow_fds) in self._slots.items():
                self._open_slot(new, source_id, slot_id, kind, OwnedFds((region_fd, overflow_fds[worker])))
        return True

    def describe_worker(self, worker: int) -> str:
        """Which actor, where it runs; for one not running yet, why it may not be."""
        handle = self._workers[worker] if worker < len(self._workers) else None
        ready = handle.ready if handle is not None else None
        if ready is not None:
            return f"worker {worker} (Ray actor pid {ready.pid} on node {ready.node_ip} ({ready.hostname}))"
        return (f"worker {worker} (a Ray actor not running yet, "
                f"{time.monotonic() - (handle.started_at if handle else self._started_at):.0f} s after "
                f"{handle.asked_by if handle else 'start()'}: it asks for {self._asked()}; "
                f"the cluster has {self._resources(import_ray())})")

    def _asked(self) -> str:
        asked = {**DEFAULT_ACTOR_OPTIONS, **(self._options or {})}
        return ", ".join(f"{k}={v!r}" for k, v in asked.items() if k != "runtime_env")

    @staticmethod
    def _resources(ray: Any) -> str:
        if not ray.is_initialized():
            return "no connection to this process any more"
        try:
            available, total = ray.available_resources(), ray.cluster_resources()
        except Exception as exc:
            return f"resources that could not be read ({type(exc).__name__}: {exc})"
        shown = sorted(k for k in total if not k.startswith("node:") and "memory" not in k)
        return ", ".join(f"{available.get(k, 0):g} of {total[k]:g} {k} free" for k in shown) or "no resources"

    # -- faults ---------------------------------------------------------------------------------

    def _actor_lost(self, worker: ActorHandle, error: BaseException) -> Fault:
        """``worker``'s call failed with Ray's ``error``: the fault that says so."""
        ray = import_ray()
        if not ray.is_initialized() or OWNER_GONE in str(error):
            # ray.shutdown() in this process (or its connection lost) fails the actors' calls
            # first, sometimes before Ray says it is disconnected: say what happened.
            return self._connection_lost(error)
        described = worker.describe()
        if isinstance(error, ray.exceptions.RayTaskError):
            def failed(held: HeldBy) -> BaseException:
                broken = InternalError(f"{described} failed outside the callback: {_first_lines(error)}")
                broken.__cause__ = error
                return broken

            return failed

        def died(held: HeldBy) -> BaseException:
            broken = WorkerDiedError(
                f"{described} died while it held {held(worker.index)}. Ray says: "
                f"{_first_lines(error)} The remaining workers were shut down.")
            broken.__cause__ = error
            return broken

        return Lost(worker.index, died)  # the pool may put a new actor in its place

    @staticmethod
    def _channel_lost(worker: ActorHandle) -> Fault:
        """``worker``'s channel closed and Ray said nothing of it in time."""
        described, index = worker.describe(), worker.index

        def fault(held: HeldBy) -> BaseException:
            return WorkerDiedError(
                f"{described} died while it held {held(index)}: its channel to the pool closed, "
                "and Ray said nothing of it. The remaining workers were shut down.")

        return Lost(index, fault)

    def _connection_lost(self, error: Optional[BaseException]) -> Fault:
        indices = [w.index for w in self._workers]
        why = "" if error is None else f" ({type(error).__name__}: {error})"

        def fault(held: HeldBy) -> BaseException:
            holding = "; ".join(f"worker {i}: {held(i)}" for i in indices if held(i) != "no samples")
            broken = WorkerDiedError(
                f"this process is no longer connected to Ray{why} (ray.shutdown(), or the cluster "
                f"went away); the extsrc ray workers held {holding or 'no samples'}. The pool was "
                "shut down.")
            broken.__cause__ = error
            return broken

        return fault

    def _kill(self, workers: List[ActorHandle]) -> None:
        """Kills the actors and waits (briefly) until Ray reports them dead; drops their calls."""
        ray = import_ray()
        if workers and ray.is_initialized():
            pings = []
            for worker in workers:
                try:
                    ray.kill(worker.actor, no_restart=True)
                    pings.append(worker.actor.ping.remote())
                except Exception:
                    pass  # gone already, or Ray is
            deadline = time.monotonic() + ACTOR_STOP_WAIT_S
            try:
                ray.wait(pings, num_returns=len(pings), timeout=ACTOR_STOP_WAIT_S)
                here = ray.get_runtime_context().get_node_id()
            except Exception:
                here = None
            # Ray reports an actor dead before its process has exited; on this host, see it go.
            for worker in workers:
                if worker.ready is not None and worker.ready.node_id == here:
                    while _running(worker.ready.pid) and time.monotonic() < deadline:
                        time.sleep(PROCESS_EXIT_POLL_S)
        for worker in workers:
            for lent in worker.lent.values():
                for fds in lent:
                    fds.close()
            for _, change_fds in worker.slot_changes:
                if change_fds is not None:
                    change_fds.close()
            worker.lent.clear()
            worker.slot_changes = []
            for _, direct_fds in worker.direct:
                if direct_fds is not None:
                    direct_fds.close()
            worker.direct.clear()
            if worker.channel is not None:
                worker.channel.close()
                worker.channel = None
            worker.calls.clear()
            worker.task_calls = 0
            worker.sent.clear()
            worker.outbox.clear()


_kept_in_child: List[Any] = []  # see RayBackend.forget_after_fork


def _start_local_ray(ray: Any) -> None:
    """``ray.init()`` so that the Ray it starts lives as long as this process.

    Ray's daemons die with the thread that started them (their parent-death
    signal is tied to it, not to the process). ``start()`` may run in any
    thread (a loader thread that ends once it has handed the data over), so
    outside the main thread the call is made by one thread of the module's
    that lives until the process ends, as the main thread would.
    """
    if threading.current_thread() is threading.main_thread():
        ray.init()
        return
    global _keeper
    with _keeper_lock:
        if _keeper is None:
            _keeper = queue.SimpleQueue()
            threading.Thread(target=_keep, args=(_keeper,), name="extsrc-ray-keeper", daemon=True).start()
        requests = _keeper
    outcome: Future = Future()
    requests.put((ray, outcome))
    outcome.result()  # ray.init()'s error, raised in the caller's thread


def _keep(requests: "queue.SimpleQueue[Tuple[Any, Future]]") -> None:
    """The keeper thread: starts a local Ray when asked, and never ends (see _start_local_ray)."""
    while True:
        ray, outcome = requests.get()
        try:
            if not ray.is_initialized():
                ray.init()
        except BaseException as exc:  # handed to the thread that asked
            outcome.set_exception(exc)
        else:
            outcome.set_result(None)


_keeper_lock = threading.Lock()
_keeper: "Optional[queue.SimpleQueue[Tuple[Any, Future]]]" = None  # the keeper thread's requests


def _forget_keeper() -> None:
    global _keeper, _keeper_lock
    _keeper_lock = threading.Lock()  # a forked child has no keeper thread: it starts its own
    _keeper = None


os.register_at_fork(after_in_child=_forget_keeper)


class RayGone(RuntimeError):
    """This process is no longer connected to Ray (``ray.shutdown()``)."""


def _connected(ray: Any) -> None:
    """Raises :class:`RayGone` unless this process is connected to Ray. Checked before each
    call of Ray from the I/O thread: after ``ray.shutdown()``, Ray's calls start a new local
    Ray on their own, here in a thread whose end would take that Ray down with it."""
    if not ray.is_initialized():
        raise RayGone("ray.shutdown() was called, or the connection to the cluster was lost")


def _file_id(fd: int) -> Tuple[int, int]:
    """``(st_dev, st_ino)`` of the file open as ``fd``."""
    stat = os.fstat(fd)
    return stat.st_dev, stat.st_ino


def _running(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _first_lines(error: BaseException) -> str:
    """Ray's message without its indented fields (class name, ids), on one line."""
    lines = [line.strip() for line in str(error).splitlines()
             if line.strip() and not line.startswith(("\t", " "))]
    text = " ".join(lines[:4])
    return text if text.endswith(".") else text + "."

