"""``ParallelSource``: epochs of batches produced by a worker pool.

The source is the consumer's side: it checks the arguments (once, in
:class:`~extsrc.options.SourceOptions`), owns or shares a
:class:`~extsrc.engine.pool.WorkerPool`, and hands out batches epoch by
epoch. Production (dispatch, results, memory) is its
:class:`~extsrc.engine.producer.Producer`'s, in the pool's I/O thread; the
consumer thread only waits for a finished batch, takes it and moves its own
cursor, all with the pool's lock held. That is why an interrupt
(``KeyboardInterrupt``) anywhere in ``next()`` leaves the source
consistent: the take is undone, and the next call returns the same batch.

Life cycle of a batch: dispatched into a free slot (I/O thread) -> written
by the workers -> every task reported back -> taken by ``next()``, which
wraps the slot's memory in a :class:`~extsrc.shm.slots.Lease` -> the
consumer's arrays hold the lease -> freed when the last reference is gone
(the slot is reused, or given back).
"""

from __future__ import annotations

import enum
import logging
import os
import time
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from extsrc.batch import Batch
from extsrc.engine.assembly import BatchOutput, PendingBatch
from extsrc.engine.pool import WorkerPool
from extsrc.engine.producer import Producer, Run
from extsrc.engine.runner import BATCH_GENERATOR, BATCH_ITERABLE, classify
from extsrc.engine.stats import SourceStats
from extsrc.errors import EmptyEpochError, SampleError, SourceTimeoutError
from extsrc.options import UNSET, SourceOptions
from extsrc.shm.slots import SlotState


class EpochState(enum.Enum):
    RUNNING = "running"  # batches come
    LAST_GIVEN = "last given"  # the final (short) batch was handed out; the next call ends it
    ENDED = "ended"  # StopIteration was raised, or the epoch was superseded or closed


class Epoch:
    """The iterator of one epoch, what ``iter(source)`` returns.

    States: RUNNING -> LAST_GIVEN -> ENDED, or RUNNING -> ENDED (the end of
    the data, an error, a newer epoch, ``close()``).
    """

    def __init__(self, source: "ParallelSource", run: Run):
        self.source = source
        self.run = run
        self.epoch_idx = run.epoch_idx
        self.next_yield = run.first_iteration
        self.state = EpochState.RUNNING

    def __iter__(self) -> "Epoch":
        return self

    def __next__(self) -> BatchOutput:
        # What a take has done so far, so that an exception arriving anywhere before the
        # batch reaches the caller (a KeyboardInterrupt) undoes it: the next call returns
        # the same batch.
        take = _Take()
        try:
            return self.source._next_batch(self, take)
        except BaseException:
            if take.pending is not None:
                self.source._undo(self, take)
            raise


class _Take:
    """The steps of one take, recorded for :meth:`ParallelSource._undo`."""

    __slots__ = ("pending", "lease", "lease_seq", "next_yield", "state")

    def __init__(self) -> None:
        self.pending: Optional[PendingBatch] = None
        self.lease: Any = None  # held here, so the batch's memory cannot be returned before _undo
        self.lease_seq = 0  # the lease seq the take makes
        self.next_yield = 0
        self.state = EpochState.RUNNING


class ParallelSource:
    """Runs ``source`` in worker processes; each ``for`` loop over it is one epoch.

    Sample mode (``batch=False``): ``source(SampleInfo)`` returns one sample,
    an array, or a tuple of ``num_outputs`` arrays; sample ``k`` of iteration
    ``i`` has ``idx_in_epoch = i * batch_size + k``. Batch mode
    (``batch=True``): ``source`` is a callable taking the iteration number (or
    a ``BatchInfo`` with ``batch_info=True``), an iterable, or a generator
    function; it returns a whole batch: a list of samples (or one array with
    the samples along axis 0), or a tuple of ``num_outputs`` such. Iterables
    and generators run in one worker, so that their state stays in one place.

    Each batch is a :class:`~extsrc.Batch` (a list of arrays), or a tuple of
    ``num_outputs`` of them. Its arrays are zero-copy views of shared memory
    and stay valid and unchanged for as long as any of them, or anything made
    from them (a slice, ``as_array()``, ``torch.from_numpy``), is referenced;
    only then is the memory reused. Holding ``n`` batches costs about ``n``
    batches of memory; ``batches_held`` (default 2) is how many held batches
    have memory kept ready for them, so that a loop holding no more than that
    allocates nothing in steady state. Batches come in index order whatever
    the number of workers or their timing.

    ``order`` (an :class:`extsrc.Order`) decides which record each position
    of an epoch loads (shuffled, sharded): the callback gets it as
    ``SampleInfo.record``, with ``SampleInfo.rng`` seeded from the order's
    seed, the epoch and the record; the epoch ends after the shard's records,
    and ``len(source)`` is the number of batches per epoch.

    Without an order, the epoch ends when the callback raises
    ``StopIteration``. ``last_batch="drop"`` drops a last batch shorter than
    ``batch_size``; ``"partial"`` yields it shorter; ``"pad"`` (with an order)
    fills it with records from the start of the epoch's order, so that every
    shard gets the same number of full batches. An epoch whose every sample
    was dropped raises :class:`~extsrc.errors.EmptyEpochError`.

    Errors: an exception in the callback (any ``BaseException``) is raised
    from ``next()`` at its batch, with its type, message and worker
    traceback, and ends the epoch; an invalid sample raises
    :class:`~extsrc.errors.SampleError`; a dead worker
    :class:`~extsrc.errors.WorkerDiedError` and a batch slower than
    ``timeout`` seconds :class:`~extsrc.errors.SourceTimeoutError` (after
    those two the pool is shut down). In a process forked from the one that
    created it, every method raises :class:`~extsrc.errors.ForkedChildError`.

    Threads: several threads may take batches from one epoch; each batch
    goes to exactly one of them, whole. ``iter()`` in one thread ends the
    epoch other threads iterate (they get ``StopIteration``).

    ``in_place=True`` (sample mode): the callback is called as
    ``source(info, buffers)`` and may write its sample straight into the
    batch's shared memory, ``buffers.array(shape, dtype)`` (see
    :class:`~extsrc.engine.runner.SampleBuffers`), so that it is written once.

    :meth:`stats` tells where the time goes (and what to change);
    ``stats_every=seconds`` also logs it to the ``extsrc`` logger that often;
    ``stats=False`` turns the collection off.

    ``dtype``/``ndim`` (one value, or one per output) declare what samples
    must be. Workers start on first use or at ``start()``; ``close()`` (or
    ``with``) stops them and frees the shared memory no batch holds. ``pool``
    shares one :class:`~extsrc.WorkerPool` between sources; then
    ``num_workers``, ``start_method``, ``pickler``, ``backend`` and
    ``ray_options`` come from the pool and giving them is an error.

    ``backend="ray"`` runs the workers as Ray actors anywhere in the cluster
    this process is connected to (or a local Ray started on first use), with
    ``ray_options`` (``num_cpus``, ``resources``, ``scheduling_strategy``,
    ``runtime_env``, ...) for the actors; everything above holds unchanged
    (see :class:`extsrc.ray.RayPool`). The default, ``"processes"``, runs
    worker processes on this host.
    """

    def __init__(
        self,
        source: Any,
        batch_size: int,
        *,
        num_outputs: Optional[int] = None,
        batch: bool = False,
        batch_info: bool = False,
        num_workers: int = UNSET,
        start_method: str = UNSET,
        pickler: Any = UNSET,
        prefetch: Optional[int] = None,
        last_batch: str = "drop",
        dtype: Any = None,
        ndim: Any = None,
        timeout: Optional[float] = None,
        batches_held: int = 2,
        pool: Optional[WorkerPool] = None,
        name: Optional[str] = None,
        order: Any = None,
        in_place: bool = False,
        stats: bool = True,
        stats_every: Optional[float] = None,
        backend: str = UNSET,
        ray_options: Optional[Dict[str, Any]] = UNSET,
    ):
        given = {k: v for k, v in (("num_workers", num_workers), ("start_method", start_method),
                                   ("pickler", pickler), ("backend", backend),
                                   ("ray_options", ray_options)) if v is not UNSET}
        if pool is None:
            pool = WorkerPool(**{"num_workers": 1, **given})
            self._owns_pool = True
        else:
            if not isinstance(pool, WorkerPool):
                raise TypeError(f"pool must be an extsrc.WorkerPool, got {type(pool).__name__}")
            if given:
                raise ValueError(
                    f"{', '.join(given)} come(s) from the shared pool (num_workers="
                    f"{pool.num_workers}, start_method={pool.start_method!r}, backend="
                    f"{pool.backend!r}); do not pass them together with pool="
                )
            self._owns_pool = False
        self.options = SourceOptions.create(
            batch_size, num_outputs=num_outputs, batch=batch, batch_info=batch_info,
            prefetch=prefetch, num_workers=pool.num_workers, tasks_per_worker=pool.max_outstanding,
            last_batch=last_batch, dtype=dtype, ndim=ndim, timeout=timeout, batches_held=batches_held,
            order=order, in_place=in_place, stats=stats, stats_every=stats_every,
        )
        if self.options.batches_per_epoch == 0:
            raise EmptyEpochError(
                f"an epoch of {len(order)} records (this shard's, of {order!r}) makes no batch of "
                f"batch_size={self.options.batch_size} with last_batch='drop'; use "
                "last_batch='partial' or 'pad', or a smaller batch_size"
            )
        kind = classify(source, self.options.batch)
        if self.options.batch_info and kind != "callable":
            raise ValueError("batch_info=True needs a callable source (not an iterable or generator)")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        self.source = source
        self.kind = kind
        self._pool = pool
        self._pid = os.getpid()
        self._producer = Producer(source, kind, self.options, pool, name)
        self.name = self._producer.name
        self._last_report = time.monotonic()
        self._epoch: Optional[Epoch] = None
        self._next_epoch = 0
        self._resume_iteration = 0
        self._closed = False

    # -- properties users read -------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    @property
    def num_outputs(self) -> Optional[int]:
        return self.options.num_outputs

    @property
    def prefetch(self) -> int:
        return self.options.prefetch

    @property
    def last_batch(self) -> str:
        return self.options.last_batch

    @property
    def timeout(self) -> Optional[float]:
        return self.options.timeout

    @property
    def batches_held(self) -> int:
        return self.options.batches_held

    @property
    def pool(self) -> WorkerPool:
        return self._pool

    def worker_pids(self) -> list:
        """The pids of the workers serving this source (empty before start and after close)."""
        return self._pool.worker_pids()

    def watch_memory(self, on_map: Any, on_unmap: Any) -> None:
        """Calls ``on_map(address, size)`` for every piece of this source's shared memory mapped
        in this process, now and whenever more is mapped, and ``on_unmap(address, size)`` right
        before a piece is unmapped. For registering the memory with a GPU runtime as page-locked
        (``cudaHostRegister``), so that batches go to the device by DMA without a copy.

        The callbacks run in the pool's thread or a consumer thread, with the pool's lock held,
        or in whatever thread drops a batch's last reference; they must be quick and not raise.
        """
        self._check_open()
        with self._pool.lock:
            self._producer.slots.watch(on_map, on_unmap)

    def shared_memory_bytes(self) -> int:
        """Shared memory this source holds now for its slots, in bytes (held batches included)."""
        self._pool.check_owner()
        with self._pool.lock:
            return self._producer.slots.reserved_bytes()

    def shared_memory_capacities(self) -> List[int]:
        """Shared memory of each batch slot this source holds now, in bytes (one batch per slot;
        empty before the first batch and after close)."""
        self._pool.check_owner()
        with self._pool.lock:
            return self._producer.slots.capacities()

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the workers now (with fork: call it before CUDA is initialised)."""
        self._check_open()
        self._pool.start()

    def close(self) -> None:
        """Stops the workers (of an owned pool) and frees the shared memory no batch holds.

        Idempotent; a loop over the source ends quietly. Batches still held
        stay valid until dropped. In a forked child it does nothing.
        """
        if self._closed or self._pid != os.getpid():
            return
        self._closed = True
        with self._pool.lock:
            epoch, self._epoch = self._epoch, None
            if epoch is not None:
                epoch.state = EpochState.ENDED
            self._pool.notify()
        if self._owns_pool:
            self._pool.close()  # frees the memory of every source once the workers stopped
        else:
            with self._pool.lock:
                self._producer.close(tell_workers=not self._pool.closed)

    def __enter__(self) -> "ParallelSource":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _check_open(self) -> None:
        self._pool.check_owner()
        if self._closed:
            raise_closed(self.name)

    # -- epochs ----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[BatchOutput]:
        """Starts the next epoch (ending an unfinished one) and returns its iterator."""
        self._check_open()
        self._pool.start()
        with self._pool.lock:
            self._pool.check_usable(self._producer.source_id)
            previous = self._epoch
            if previous is not None:
                previous.state = EpochState.ENDED
            if self._producer.stats is not None and self._producer.stats.batches == 0:
                self._producer.stats.reset()  # the window starts with the first epoch
            run = self._producer.request(self._next_epoch, self._resume_iteration)
            assert run is not None
            self._epoch = Epoch(self, run)
            self._next_epoch += 1
            self._resume_iteration = 0
            self._pool.notify()
            return self._epoch

    def __len__(self) -> int:
        """Batches per epoch; known with ``order=`` only (else the callback ends the epoch)."""
        batches = self.options.batches_per_epoch
        if batches is None:
            raise TypeError(
                "len() of a ParallelSource needs order= (an extsrc.Order): without one, the "
                "callback ends each epoch by raising StopIteration"
            )
        return batches

    def get_state(self) -> Dict[str, Any]:
        """Where the source stands: the next batch it would hand out (JSON-able, small).

        With an order, the state also records the order's settings, so that
        :meth:`set_state` can refuse a state saved with another order.
        """
        self._pool.check_owner()
        with self._pool.lock:
            epoch = self._epoch
            if epoch is not None and epoch.state is EpochState.RUNNING:
                state: Dict[str, Any] = {"epoch_idx": epoch.epoch_idx, "iteration": epoch.next_yield}
            else:
                state = {"epoch_idx": self._next_epoch, "iteration": self._resume_iteration}
        if self.options.order is not None:
            state["order"] = self.options.order.describe()
        return state

    def set_state(self, state: Dict[str, int]) -> None:
        """Makes the next ``iter()`` resume at ``state`` (from :meth:`get_state`).

        Raises ``ValueError`` for a state not made by :meth:`get_state`, and
        for resuming mid-epoch an iterable source (it cannot be rewound).
        """
        epoch_idx, iteration = _parse_state(state)
        order = self.options.order
        saved = state.get("order")
        if order is not None and saved is not None and saved != order.describe():
            raise ValueError(
                f"set_state: the state was saved with the order {saved}, and this source has "
                f"{order.describe()}; resuming would load other records"
            )
        if iteration and self.kind in (BATCH_ITERABLE, BATCH_GENERATOR):
            raise ValueError("resuming in the middle of an epoch needs a callable source, not an iterable")
        self._check_open()
        with self._pool.lock:
            if self._epoch is not None:
                self._epoch.state = EpochState.ENDED
                self._epoch = None
            self._producer.request(None)
            self._next_epoch, self._resume_iteration = epoch_idx, iteration

    def _end(self, epoch: Epoch) -> None:
        """Ends ``epoch`` (lock held): production stops; the next iter() starts anew."""
        epoch.state = EpochState.ENDED
        if self._epoch is epoch:
            self._producer.request(None)

    # -- taking a batch --------------------------------------------------------------------------

    def _next_batch(self, epoch: Epoch, take: "_Take") -> BatchOutput:
        pool = self._pool
        pool.check_owner()
        producer = self._producer
        stats = producer.stats
        asked = time.perf_counter_ns() if stats is not None else 0
        deadline = None if self.options.timeout is None else time.monotonic() + self.options.timeout
        while True:
            with pool.lock:
                waiter = self._ready_or_waiter(epoch, deadline)  # or raises StopIteration, an error
                if waiter is None:
                    pending = producer.ready(epoch.run, epoch.next_yield)
                    assert pending is not None
                    decision = self._decide(epoch, pending)
                    ready = producer.ready_count() - 1 if stats is not None else 0
                    take.next_yield, take.state = epoch.next_yield, epoch.state
                    take.lease_seq = pending.slot.lease_seq + 1
                    take.pending = pending
                    take.lease = producer.slots.take(pending.slot, pending.overflow_sizes(decision.size))
                    producer.commit(pending)
                    epoch.next_yield += 1
                    if decision.ended:
                        epoch.state = EpochState.LAST_GIVEN
                    break
            # Waiting happens outside the lock (see extsrc.engine.pool).
            remaining = -1 if deadline is None else max(0.0, deadline - time.monotonic())
            waiter.acquire(True, remaining)
        # The arrays are made without the lock: the slot is the consumer's now, and its memory
        # is reached only through the lease.
        try:
            outcome = pending.build(take.lease, decision.size, self.options.num_outputs)
        except SampleError:
            take.pending = None  # not undone: the batch is bad; its slot returns with the lease
            with pool.lock:
                self._end(epoch)
            raise
        outcome = self._finish(outcome)
        if stats is not None:
            stats.took(decision.size, _nbytes(outcome), time.perf_counter_ns() - asked, ready,
                       take.next_yield == epoch.run.first_iteration)
            if self.options.stats_every is not None:
                self._maybe_report()
        return outcome

    # -- statistics ------------------------------------------------------------------------------

    def stats(self, reset: bool = False) -> SourceStats:
        """Where the time went since the first batch (or the last ``stats(reset=True)``).

        A :class:`~extsrc.engine.stats.SourceStats`: batches, samples and bytes
        delivered, the time the consumer waited, each worker's busy fraction,
        the callback's time per sample, the batches ready ahead, the shared
        memory in use; ``str()`` of it is a short report ending in a diagnosis.
        ``reset=True`` starts a new window after taking this one. Raises
        ``RuntimeError`` if the source was made with ``stats=False``.
        """
        self._pool.check_owner()
        collector = self._producer.stats
        if collector is None:
            raise RuntimeError(f"source {self.name} was made with stats=False: it collects no statistics")
        with self._pool.lock:
            snapshot = collector.snapshot(
                self.name, self._producer.ready_count(), self._producer.slots.reserved_bytes(),
                self.options.prefetch, self.options.batch_size,
            )
            if reset:
                collector.reset()
        return snapshot

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._last_report >= self.options.stats_every:
            self._last_report = now
            logging.getLogger("extsrc").info("%s", self.stats())

    def _undo(self, epoch: Epoch, take: "_Take") -> None:
        """Undoes an interrupted take (see :meth:`Epoch.__next__`): the next call returns the
        same batch. Each step is checked, since the interrupt may have come before it."""
        pending = take.pending
        with self._pool.lock:
            producer = self._producer
            if epoch is not self._epoch or epoch.state is EpochState.ENDED:
                return
            epoch.next_yield = take.next_yield
            epoch.state = take.state
            if producer.run is not epoch.run:
                return
            if producer.slots.holds(pending.slot, pending.seq, take.lease_seq):
                if pending.slot.state is SlotState.LEASED:
                    producer.slots.untake(pending.slot, take.lease)
                if pending.iteration not in producer.pending:
                    producer.uncommit(pending)
            else:
                # The take was cut inside the slot pool and the batch's memory went back:
                # produce the epoch again from this batch on.
                epoch.run = producer.request(epoch.epoch_idx, take.next_yield)
            self._pool.notify()

    def _ready_or_waiter(self, epoch: Epoch, deadline: Optional[float]) -> Any:
        """Lock held: ``None`` when the epoch's next batch is ready, else a waiter to wait on.

        Raises ``StopIteration`` at the end of the epoch, the pool's fault, a
        failed dispatch, or :class:`SourceTimeoutError` past ``deadline``.
        """
        pool, producer = self._pool, self._producer
        if epoch.state is EpochState.LAST_GIVEN:
            self._end(epoch)
            raise StopIteration
        if epoch.state is EpochState.ENDED or epoch is not self._epoch:
            raise StopIteration  # superseded by a newer epoch, set_state() or close()
        batches = self.options.batches_per_epoch
        if batches is not None and epoch.next_yield >= batches:
            self._end(epoch)
            raise StopIteration  # the order's epoch is over
        pool.check_usable(producer.source_id)
        if producer.ready(epoch.run, epoch.next_yield) is not None:
            return None
        failure = producer.failure(epoch.run, epoch.next_yield)
        if failure is not None:
            self._end(epoch)
            raise failure
        if deadline is not None and deadline - time.monotonic() <= 0:
            raise self._timed_out(epoch)
        return pool.waiter()

    def _decide(self, epoch: Epoch, pending: PendingBatch) -> Any:
        """Lock held: what the ready batch becomes; raises at the end of the epoch or an error."""
        decision = pending.decide(self.options.last_batch, self.name)
        if decision.error is None and decision.size:
            return decision
        self._end(epoch)
        if decision.error is not None:
            raise decision.error
        if decision.produced and epoch.next_yield == 0 and epoch.run.first_iteration == 0:
            raise EmptyEpochError(
                f"source {self.name}: epoch {epoch.epoch_idx} ended after {decision.produced} "
                f"samples, fewer than batch_size={self.options.batch_size}, and "
                "last_batch='drop' dropped them all, so the epoch has no batch. Use "
                f"last_batch='partial', or a batch_size of at most {decision.produced}."
            )
        raise StopIteration

    def _finish(self, outcome: BatchOutput) -> BatchOutput:
        """Outputs that came uniform but spilled (the first batch) become one dense array."""
        outputs = (outcome,) if self.options.num_outputs is None else outcome
        if all(samples.is_dense or not samples for samples in outputs):
            return outcome
        finished = []
        for samples in outputs:
            if not samples.is_dense and samples and _uniform(samples):
                samples = Batch(dense=np.stack(samples))  # a copy, for this batch only
            finished.append(samples)
        return finished[0] if self.options.num_outputs is None else tuple(finished)

    def _timed_out(self, epoch: Epoch) -> SourceTimeoutError:
        stuck = []
        pending = self._producer.pending.get(epoch.next_yield)
        rows = self._pool.running_tasks(self._producer.source_id)
        # The batch's own tasks, and what the workers holding them are running instead.
        holding = {worker for worker, _, task, _ in rows if pending is None or task.batch_seq == pending.seq}
        for worker, described, task, running in rows:
            if pending is None or task.batch_seq == pending.seq or (worker in holding and running):
                state = f"running for {running:.1f} s" if running else "queued behind another task"
                stuck.append(f"{described}: {self._producer.describe_task(task)}, {state}")
        error = SourceTimeoutError(
            f"batch {epoch.next_yield} of epoch {epoch.epoch_idx} of source {self.name} was not "
            f"ready after timeout={self.options.timeout} s. Stuck: "
            + ("; ".join(stuck) if stuck else "no task was running")
            + ". The workers were shut down."
        )
        self._pool.fail(error)
        self._pool.check_usable(self._producer.source_id)  # marks it as reported
        return error


def _nbytes(outcome: BatchOutput) -> int:
    outputs = outcome if isinstance(outcome, tuple) else (outcome,)
    total = 0
    for samples in outputs:
        total += samples.as_array().nbytes if samples.is_dense else sum(s.nbytes for s in samples)
    return total


def _uniform(samples: Batch) -> bool:
    first = samples[0]
    return all(s.shape == first.shape and s.dtype == first.dtype for s in samples)


def _parse_state(state: Any) -> tuple:
    expected = "a dict {'epoch_idx': int, 'iteration': int} as returned by get_state()"
    if not isinstance(state, dict):
        raise ValueError(f"set_state expects {expected}, got {type(state).__name__} {state!r}")
    missing = [k for k in ("epoch_idx", "iteration") if k not in state]
    if missing:
        raise ValueError(f"set_state expects {expected}; {state!r} lacks {', '.join(missing)}")
    values = []
    for key in ("epoch_idx", "iteration"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"set_state: {key} must be an int >= 0, got {value!r}")
        values.append(int(value))
    return tuple(values)


def raise_closed(name: str) -> None:
    from extsrc.errors import PoolClosedError

    raise PoolClosedError(f"source {name} is closed; no batches can be taken after close()")
