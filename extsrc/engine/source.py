"""``ParallelSource``: epochs of batches produced by a worker pool.

The source is the consumer's side: it checks the arguments (once, in
:class:`~extsrc.engine.spec.SourceSpec`), owns or shares a
:class:`~extsrc.engine.pool.WorkerPool`, and hands out batches epoch by
epoch. Production (dispatch, results, memory) is its
:class:`~extsrc.engine.producer.Producer`'s, in the pool's I/O thread; the
consumer thread only waits for a finished batch and takes it
(:mod:`extsrc.engine.take`: a take that no interrupt can split, so every
batch is handed over exactly once, whatever arrives during ``next()``).

Life cycle of a batch: dispatched into a free slot (I/O thread) -> written
by the workers -> every task reported back -> taken by ``next()``, which
wraps the slot's memory in a :class:`~extsrc.shm.slots.Lease` -> the
consumer's arrays hold the lease -> freed when the last reference is gone
(the slot is reused, or given back).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import time
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple, Union

import numpy as np

from extsrc.closing import ClosedWhenCollected
from extsrc.engine.assembly import BatchOutput
from extsrc.checks import is_int
from extsrc.engine.concurrent import is_async
from extsrc.engine.faults import OnError, SampleFault
from extsrc.engine.hooks import Hooks
from extsrc.engine.kinds import BATCH_CALLABLE, SAMPLE, STREAMS, Source, SourceKind, classify
from extsrc.engine.pool import WorkerPool
from extsrc.engine.producer import Producer, Run
from extsrc.engine.refill import Refill
from extsrc.engine.spec import UNSET, DTypes, NDims, PoolSpec, SourceSpec
from extsrc.engine.stats import SourceStats, publish
from extsrc.engine.take import EpochState, Taker
from extsrc.errors import EmptyEpochError, StateMismatchError
from extsrc.order import Order


class ParallelSource(ClosedWhenCollected):
    """Runs ``source`` in worker processes; each ``for`` loop over it is one epoch.

    Sample mode (``batch=False``): ``source(SampleInfo)`` returns one sample,
    an array, or a tuple of ``num_outputs`` arrays; sample ``k`` of iteration
    ``i`` has ``idx_in_epoch = i * batch_size + k``. Batch mode
    (``batch=True``): ``source`` is a callable taking the iteration number (or
    a ``BatchInfo`` with ``hooks=Hooks(batch_info=True)``), an iterable, or a generator
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
    from ``next()`` in the place of its batch, with its type, message and
    worker traceback, and the epoch goes on with the next batch; an invalid
    sample raises
    :class:`~extsrc.errors.SampleError`; a dead worker
    :class:`~extsrc.errors.WorkerDiedError` and a batch slower than
    ``timeout`` seconds :class:`~extsrc.errors.SourceTimeoutError` (after
    those two the pool is shut down). In a process forked from the one that
    created it, every method raises :class:`~extsrc.errors.ForkedChildError`.

    Bad data and lost workers (see docs/engine.md): ``on_error="skip"``
    leaves out a sample whose callback raised, and the batches after it are
    refilled from the next ones (:mod:`extsrc.engine.refill`), so each stays
    whole; ``on_error(info, error)`` returns a sample in its place;
    ``max_errors`` is an epoch's budget of such samples (a count, or a
    fraction of an order's records), past which the batch raises
    :class:`~extsrc.errors.TooManyErrorsError`; :meth:`faults` lists them.
    ``pool=PoolSpec(worker_restarts=N)`` replaces up to ``N`` lost workers, their batches
    redone, before a loss raises ``WorkerDiedError``.

    Threads: several threads may take batches from one epoch; each batch
    goes to exactly one of them, whole. A source serves one loop at a time:
    a newer ``iter()`` (or ``set_state()``) ends the running epoch, whose
    next ``next()`` then raises :class:`~extsrc.errors.EpochSupersededError`
    (two loops over one source would each get only some of the batches).

    Interrupts: whatever exception arrives during ``next()`` (a
    ``KeyboardInterrupt``, a second one, another signal handler's), every
    batch is still handed over exactly once: the next call returns the batch
    the interrupted one did not (see :mod:`extsrc.engine.take`).

    ``in_place=True`` (sample mode): the callback is called as
    ``source(info, buffers)`` and may write its sample straight into the
    batch's shared memory, ``buffers.array(shape, dtype)`` (see
    :class:`~extsrc.engine.runner.SampleBuffers`), so that it is written once.

    :meth:`stats` tells where the time goes (and what to change);
    ``stats=seconds`` also reports it that often: to the ``extsrc``
    logger (INFO) when logging is configured, else to stderr;
    ``stats=False`` turns the collection off.

    Callbacks that wait (object stores, HTTP, network file systems):
    ``concurrency=N`` keeps up to ``N`` samples in flight per worker, each
    written to the batch's shared memory as soon as it is back. An ``async
    def`` callback is awaited on the worker's event loop (one per worker,
    made in the worker; in batch mode the callback gathers its own requests);
    a plain callback runs on ``N`` threads of each worker. Batches are the
    same as with ``concurrency=1``: in order, whole, and the outcome of a
    StopIteration or an exception is that of the first sample (by position)
    to raise it. With ``timeout``, a sample in flight longer than it fails
    its batch with a :class:`~extsrc.errors.SourceTimeoutError` naming the
    sample and where it waited (then the workers are shut down); that
    happens at 0.8 x ``timeout`` in flight, so that the worker, which knows
    the sample, reports before the consumer's own deadline for the batch.

    ``num_outputs="auto"``: each sample is a tuple of arrays, as many as the
    first sample has (learnt from the workers' first results, so this
    process never runs the callback to know it); every batch is a tuple of
    that many outputs, and a sample with another number raises
    :class:`~extsrc.errors.SampleError` at its batch. ``num_outputs`` then
    tells the learnt number (0 before the first results).

    ``hooks`` (an :class:`~extsrc.Hooks`) changes how the source is run
    where a layer or a user needs it: ``worker_init(worker_index,
    num_workers)`` once in each worker before its first task,
    ``begin_epoch(source, epoch_idx)`` before each pass of an iterable,
    ``batch_info=True`` (a batch callable gets a ``BatchInfo``),
    ``assign(iteration, num_workers)`` (each batch made whole by the worker it
    names, e.g. DataLoader's round robin), ``dense_arrays=True`` (a dense
    output comes as one ``numpy.ndarray`` rather than a ``Batch``).

    ``in_order=False``: when the epoch's next batch is not finished and a
    later one is, ``next()`` hands out the later one (the earliest finished),
    so a batch that is slow to make holds back no other (DataLoader's
    ``in_order=False``). Each batch still holds the samples of its iteration
    (``SampleInfo`` and ``Order`` as in order), each comes once, and the
    epoch has the same batches; only the order they arrive in depends on
    timing (with ``on_error="skip"``, a batch that lost samples is filled
    from the batch that comes next, so which records share a batch depends
    on timing too). Only whole batches come early: a short last batch, the end of
    the epoch and a batch's error come in their place. Without an order,
    the callback must end the epoch at every sample past its end (as one
    over a sequence does); a batch handed out early that the epoch's end
    then falls before raises :class:`~extsrc.errors.EpochLengthError`.
    :meth:`get_state` records the batches handed out early, and a resume
    skips them.

    ``dtype``/``ndim`` (one value, or one per output) declare what samples
    must be. Workers start on first use or at ``start()``; ``close()`` (or
    ``with``) stops them and frees the shared memory no batch holds.

    The workers: ``num_workers`` and ``start_method`` make a pool of worker
    processes for this source alone. ``pool=`` takes the rest: a
    :class:`~extsrc.PoolSpec` (``pickler``, ``backend``, ``worker_restarts``
    too) makes a pool for this source alone, closed with it; a
    :class:`~extsrc.WorkerPool` is shared with other sources and closed by
    its maker. With either, ``num_workers`` and ``start_method`` are the
    pool's and giving them too is an error. ``PoolSpec(backend="ray")`` runs
    the workers as Ray actors anywhere in the cluster this process is
    connected to (or a local Ray started on first use); everything above
    holds unchanged (see :class:`extsrc.ray.RayBackend`).
    """

    def __init__(
        self,
        source: Source,
        batch_size: int,
        *,
        num_outputs: Union[None, int, str] = None,  # a count, or AUTO_OUTPUTS
        batch: bool = False,
        num_workers: int = UNSET,
        start_method: str = UNSET,
        pool: Union[None, WorkerPool, PoolSpec] = None,
        prefetch: Optional[int] = None,
        last_batch: str = "drop",
        dtype: DTypes = None,  # a NumPy dtype (anything np.dtype() takes), or one per output
        ndim: NDims = None,
        timeout: Optional[float] = None,
        batches_held: int = 2,
        name: Optional[str] = None,
        order: Optional[Order] = None,
        in_place: bool = False,
        in_order: bool = True,
        concurrency: int = 1,
        stats: Union[bool, float] = True,
        hooks: Optional[Hooks] = None,
        on_error: OnError = "raise",
        max_errors: Union[None, int, float] = None,
    ):
        pool, self._owns_pool = _own_or_shared_pool(pool, num_workers=num_workers, start_method=start_method)
        self.spec = SourceSpec(
            batch_size, num_outputs=num_outputs, batch=batch, prefetch=prefetch,
            last_batch=last_batch, dtype=dtype, ndim=ndim, timeout=timeout,
            batches_held=batches_held, order=order, in_place=in_place, stats=stats,
            concurrency=concurrency, in_order=in_order, hooks=Hooks() if hooks is None else hooks,
            on_error=on_error, max_errors=max_errors)
        kind = _checked_kind(source, self.spec, pool, order)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        self.source = source
        self.kind = kind
        self._pool = pool
        self._pid = os.getpid()
        engine_spec = _refilled(self.spec)
        self._producer = Producer(source, kind, engine_spec, pool, name)
        self.name = self._producer.name
        self._last_report = time.monotonic()
        self._taker = Taker(pool, self._producer, engine_spec, self.name,
                            report=None if self.spec.stats_every is None else self._maybe_report)
        self._next_epoch = 0
        self._resume_iteration = 0
        self._resume_skip: FrozenSet[int] = frozenset()  # handed out after it (in_order=False)
        self._resume_faults = 0  # samples of the resumed epoch skipped or replaced before it
        self._resume_carry: Dict[int, int] = {}  # batch -> good samples handed out (on_error="skip")
        self._resume_given = 0  # batches of the resumed epoch handed out (on_error="skip")
        self._resume_discard = 0  # of them, those to make again and drop (last_batch="pad")
        self._refill: Optional[Refill] = None  # the running epoch's, with on_error="skip"
        self._early: Optional[Run] = None  # the next epoch's run, filled by start() ahead of iter()
        self._closed = False
        self._close_done = False  # close() ran to its end

    # -- properties users read -------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.spec.batch_size

    @property
    def num_outputs(self) -> Optional[int]:
        """Outputs per sample (``None``: one array); with ``num_outputs="auto"``, as learnt
        from the first results (0 until then)."""
        return self._producer.num_outputs

    @property
    def prefetch(self) -> int:
        """Batches made ahead at once: as given, or by default two per worker, twice that
        once the batches turn out to be at most 1 MiB (every output of a known layout)."""
        return self._producer.prefetch

    @property
    def last_batch(self) -> str:
        return self.spec.last_batch

    @property
    def timeout(self) -> Optional[float]:
        return self.spec.timeout

    @property
    def batches_held(self) -> int:
        return self.spec.batches_held

    @property
    def pool(self) -> WorkerPool:
        return self._pool

    def worker_pids(self) -> List[int]:
        """The pids of the workers serving this source (empty before start and after close)."""
        return self._pool.worker_pids()

    def watch_memory(self, on_map: Callable[[int, int], None], on_unmap: Callable[[int, int], None]) -> None:
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
        """Shared memory this source holds now for its slots, in bytes: held batches included,
        after :meth:`close` too, until they are dropped."""
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

    def start(self, fill: bool = True) -> None:
        """Starts the workers now (with fork: call it before CUDA is initialised), and with
        ``fill`` the next epoch's production: its first ``prefetch`` batches are made while the
        program does something else (compiles a model), and the ``iter()`` that starts that
        epoch takes them. ``fill=False`` starts only the workers; production then begins at
        ``iter()``. Nothing is filled while a loop runs, or after the source's last epoch."""
        self._check_open()
        self._pool.start()
        if not fill:
            return
        with self._pool.lock:
            current = self._taker.current
            if self._early is None and (current is None or not current.goes_on()):
                self._early = self._producer.request(self._next_epoch, self._resume_iteration,
                                                     self._resume_skip)
                self._pool.notify()

    def close(self) -> None:
        """Stops the workers (of an owned pool) and frees the shared memory no batch holds.

        Idempotent; a loop over the source ends quietly. Batches still held
        stay valid until dropped. In a forked child it does nothing.
        """
        if self._close_done or self._pid != os.getpid():
            return
        # Unusable from here; a close() interrupted (KeyboardInterrupt) below is finished by the
        # next call: each step may be repeated.
        self._closed = True
        with self._pool.lock:
            self._early = None
            self._taker.close()
            self._pool.notify()
        if self._owns_pool:
            self._pool.close()  # frees the memory of every source once the workers stopped
        else:
            with self._pool.lock:
                self._producer.close(tell_workers=not self._pool.closed)
        self._close_done = True

    def __enter__(self) -> "ParallelSource":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        self._pool.check_owner()
        if self._closed:
            raise_closed(self.name)

    # -- epochs ----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[BatchOutput]:
        """Starts the next epoch and returns its iterator (an :class:`~extsrc.engine.take.Epoch`).

        An unfinished epoch is ended: its next ``next()`` raises
        :class:`~extsrc.errors.EpochSupersededError`.
        """
        self._check_open()
        self._pool.start(self._producer.source_id)  # a fault while idle is raised here, once
        with self._pool.lock:
            self._pool.check_usable(self._producer.source_id)
            if self._producer.stats is not None and self._producer.stats.batches == 0:
                self._producer.stats.reset()  # the window starts with the first epoch
            run, self._early = self._early, None
            if run is None or self._producer.requested is not run:  # none filled since start()
                run = self._producer.request(self._next_epoch, self._resume_iteration, self._resume_skip)
            assert run is not None
            epoch = self._taker.begin(run)
            self._producer.faults.resume(run.epoch_idx, self._resume_faults)
            refill = self._refill = None if self.spec.on_error != "skip" else Refill(
                epoch, self.spec.batch_size, self.spec.last_batch, self.spec.batches_per_epoch,
                functools.partial(self._producer.faults.count, run.epoch_idx),
                self._resume_carry, self._resume_given, self._resume_discard)
            self._next_epoch += 1
            self._resume_iteration = 0
            self._resume_skip = frozenset()
            self._resume_faults = self._resume_given = self._resume_discard = 0
            self._resume_carry = {}
            self._pool.notify()
            return epoch if refill is None else refill

    @property
    def next_epoch_idx(self) -> int:
        """The ``epoch_idx`` the next ``iter()`` starts (its callbacks see it in their info):
        e.g. to prepare, before that ``iter()``, what the workers read for that epoch."""
        with self._pool.lock:
            return self._next_epoch

    def __len__(self) -> int:
        """Batches per epoch; known with ``order=`` only (else the callback ends the epoch)."""
        batches = self.spec.batches_per_epoch
        if batches is None:
            raise TypeError(
                "len() of a ParallelSource needs order= (an extsrc.Order): without one, the "
                "callback ends each epoch by raising StopIteration"
            )
        return batches

    def get_state(self) -> Dict[str, Any]:
        """Where the source stands: the next batch it would hand out (JSON-able, small).

        The state records what resuming needs to be exact: the position
        (``epoch_idx``, ``iteration``, and ``records``, the samples of the
        epoch before it), ``batch_size``, whether the source is in batch mode,
        and the order's settings, so that :meth:`set_state` refuses a state
        that would load other records. With ``in_order=False``, ``handed_out``
        lists the later iterations already handed out (only when there are).
        """
        self._pool.check_owner()
        with self._pool.lock:
            epoch, refill = self._taker.current, self._refill
            if epoch is not None and refill is not None and refill.epoch is epoch and refill.goes_on():
                return self.refill_state(refill)
            if epoch is not None and epoch.state is EpochState.RUNNING:
                iteration, handed_out = epoch.position()
                batches = self.spec.batches_per_epoch
                if batches is None or iteration < batches:
                    return self._state_of(epoch.epoch_idx, iteration, handed_out,
                                          self._producer.faults.count(epoch.epoch_idx))
                # An order's last batch was handed out: the next batch is the next epoch's, as
                # once the loop saw the end (a short last batch says so at once).
            state = self._state_of(self._next_epoch, self._resume_iteration,
                                   sorted(self._resume_skip), self._resume_faults)
            if self._resume_given or self._resume_carry:
                state["refill"] = {"given": self._resume_given,
                                   "carry": [list(c) for c in sorted(self._resume_carry.items())]}
                if self._resume_discard:
                    state["refill"]["discard"] = self._resume_discard
            return state

    def refill_state(self, refill: Refill, given: Optional[int] = None) -> Dict[str, Any]:
        """The state after ``given`` batches (default: those handed out) of ``refill``, the
        running epoch of a source with ``on_error="skip"``; for a layer that runs ahead."""
        at = refill.position(given)
        state = self._state_of(refill.epoch_idx, at.iteration, list(at.handed_out), at.faults)
        if at.carry or at.given:
            # The batches' good samples handed out (on_error="skip"), and the batches (for "pad").
            state["refill"] = {"given": at.given, "carry": [list(c) for c in at.carry]}
            if at.discard:
                state["refill"]["discard"] = at.discard
        return state

    def _state_of(self, epoch_idx: int, iteration: int, handed_out: List[int], faults: int) -> Dict[str, Any]:
        state: Dict[str, Any] = {
            "epoch_idx": epoch_idx, "iteration": iteration,
            "batch_size": self.spec.batch_size, "records": iteration * self.spec.batch_size,
            "batch": self.spec.batch,
        }
        if handed_out:
            state["handed_out"] = handed_out
        if faults:
            state["faults"] = faults  # counted against max_errors after the resume too
        if self.spec.order is not None:
            state["order"] = self.spec.order.describe()
        return state

    def set_state(self, state: Dict[str, Any]) -> None:
        """Makes the next ``iter()`` resume at ``state`` (from :meth:`get_state`), exactly.

        A state saved with another ``batch_size`` resumes at the same record
        when the position falls on a batch boundary of this source (e.g. 48
        records: batch 6 of 8, or 3 of 16); otherwise, or when it was saved
        with another order or shard, in the other mode (batch/sample), or
        without an order by a source that has one (or the reverse), it raises
        :class:`~extsrc.errors.StateMismatchError` saying what differs. Raises
        ``ValueError`` for a state not made by :meth:`get_state`, and for
        resuming mid-epoch an iterable source (it cannot be rewound). A running
        loop is ended (its next ``next()`` raises ``EpochSupersededError``).
        """
        epoch_idx, iteration = parse_state(state)
        skip = _parse_handed_out(state, iteration)
        if skip and state.get("batch_size", self.spec.batch_size) != self.spec.batch_size:
            raise StateMismatchError(
                f"set_state: the state was saved with batch_size={state.get('batch_size')} after "
                f"batches {sorted(skip)} were handed out ahead of batch {iteration} "
                f"(in_order=False), and this source has batch_size={self.spec.batch_size}: "
                "resuming would repeat or skip records. Resume with the same batch_size")
        refilled = _parse_refill(state, state.get("batch_size", self.spec.batch_size))
        if refilled[1] and state.get("batch_size", self.spec.batch_size) != self.spec.batch_size:
            raise StateMismatchError(
                f"set_state: the state was saved with batch_size={state.get('batch_size')} in the "
                "middle of a batch refilled after on_error='skip', and this source has "
                f"batch_size={self.spec.batch_size}: resuming would repeat or skip records. "
                "Resume with the same batch_size")
        iteration = self._check_state(state, iteration)
        if iteration and self.kind in STREAMS:
            raise ValueError("resuming in the middle of an epoch needs a callable source, not an iterable")
        self._check_open()
        with self._pool.lock:
            early = self._early
            if early is not None and (early.epoch_idx, early.first_iteration, early.skip) == (
                    epoch_idx, iteration, skip):
                return  # start() fills that very position already (the DALI drop-in's first run)
            self._early = None
            self._taker.supersede("set_state()")
            self._producer.request(None)
            self._next_epoch, self._resume_iteration, self._resume_skip = epoch_idx, iteration, skip
            self._resume_faults = _parse_count(state, "faults") if iteration or skip else 0
            self._resume_given, self._resume_carry, self._resume_discard = refilled

    def _check_state(self, state: Dict[str, Any], iteration: int) -> int:
        """The iteration of this source at which ``state`` resumes exactly; raises
        :class:`StateMismatchError` when there is none."""
        order = self.spec.order
        saved_order = state.get("order")
        if "batch_size" in state:  # a full state (bare {epoch_idx, iteration} are the layers' own)
            if (saved_order is None) != (order is None):
                raise StateMismatchError(
                    "set_state: the state was saved by a source "
                    + ("with the order " + str(saved_order) + ", and this one has none"
                       if order is None else "without an order, and this one has " + repr(order))
                    + "; resuming would load other records"
                )
            if bool(state.get("batch", self.spec.batch)) != self.spec.batch:
                raise StateMismatchError(
                    f"set_state: the state was saved by a source with batch={state.get('batch')}, and "
                    f"this one has batch={self.spec.batch}; its positions count other things"
                )
        if order is not None and saved_order is not None and saved_order != order.describe():
            differs = [k for k, value in order.describe().items() if saved_order.get(k) != value]
            raise StateMismatchError(
                f"set_state: the state was saved with the order {saved_order}, and this source has "
                f"{order.describe()} (differing in {', '.join(differs)}); resuming would load "
                "other records"
            )
        saved_size = state.get("batch_size")
        batch_size = self.spec.batch_size
        if saved_size is None or saved_size == batch_size:
            return iteration
        if isinstance(saved_size, bool) or not isinstance(saved_size, int) or saved_size <= 0:
            raise ValueError(f"set_state: batch_size must be an int > 0, got {saved_size!r}")
        records = iteration * saved_size
        if self.spec.batch and iteration:
            raise StateMismatchError(
                f"set_state: the state was saved at batch {iteration} of a batch-mode source with "
                f"batch_size={saved_size}, and this one has batch_size={batch_size}: the callback "
                "makes whole batches, so there is no batch of this source to resume at"
            )
        if records % batch_size:
            raise StateMismatchError(
                f"set_state: the state was saved after {records} records (batch {iteration} of "
                f"batch_size={saved_size}), which is not a batch boundary of this source's "
                f"batch_size={batch_size}: resuming would skip or repeat "
                f"{records % batch_size} records. Resume with batch_size={saved_size}, or one "
                f"that divides {records}"
            )
        return records // batch_size

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
                self._producer.prefetch, self.spec.batch_size,
            )
            if reset:
                collector.reset()
            ledger = self._producer.faults
            return dataclasses.replace(snapshot, skipped=ledger.skipped, replaced=ledger.replaced,
                                       worker_restarts=len(self._pool.restarts))

    def faults(self) -> List[SampleFault]:
        """The samples the callback failed on that ``on_error`` skipped or replaced, oldest
        first (the newest 1,000; ``stats()`` counts all): each names its record, batch,
        epoch and the error's type and message, to find the bad data."""
        with self._pool.lock:
            return list(self._producer.faults.listed)

    def _maybe_report(self) -> None:
        now = time.monotonic()
        every = self.spec.stats_every
        if every is not None and now - self._last_report >= every:
            self._last_report = now
            publish(self.stats())


def _own_or_shared_pool(pool: Union[None, WorkerPool, PoolSpec], **shortcuts: Any) -> Tuple[WorkerPool, bool]:
    """``(pool, whether the source owns it)``: the shared ``pool``, or one made of the spec
    ``pool`` or of the ``shortcuts`` (``num_workers``, ``start_method``: ``UNSET`` where not
    given)."""
    given = {k: v for k, v in shortcuts.items() if v is not UNSET}
    if pool is None:
        return WorkerPool(**{"num_workers": 1, **given}), True
    if not isinstance(pool, (WorkerPool, PoolSpec)):
        raise TypeError(f"pool must be an extsrc.WorkerPool or an extsrc.PoolSpec, got {type(pool).__name__}")
    spec = pool.spec if isinstance(pool, WorkerPool) else pool
    if given:
        raise ValueError(
            f"{', '.join(given)} come(s) from pool= (num_workers={spec.num_workers}, start_method="
            f"{spec.start_method!r}, backend={spec.backend!r}); give them in the pool, not beside it"
        )
    if isinstance(pool, WorkerPool):
        return pool, False
    return WorkerPool.from_spec(pool), True


def _checked_kind(source: Source, spec: SourceSpec, pool: WorkerPool, order: Optional[Order]) -> SourceKind:
    """The source's kind (:mod:`extsrc.engine.kinds`), once what it needs was checked against
    the spec and the pool."""
    if spec.batches_per_epoch == 0 and order is not None:  # 0 only with an order
        raise EmptyEpochError(
            f"an epoch of {len(order)} records (this shard's, of {order!r}) makes no batch of "
            f"batch_size={spec.batch_size} with last_batch='drop'; use "
            "last_batch='partial' or 'pad', or a smaller batch_size"
        )
    kind = classify(source, spec.batch)
    if (spec.concurrency > 1 or is_async(source)) and not pool.workers_backend.concurrent_samples:
        raise ValueError(
            f"concurrency={spec.concurrency} and async def callbacks need a backend "
            "whose workers run samples concurrently, such as backend='processes' (worker "
            f"processes on this host), got backend={pool.backend!r}"
        )
    if is_async(source) and spec.in_place:
        raise ValueError("in_place=True needs a plain callback (it writes into the sample's "
                         "room before returning), got an async def one")
    if spec.on_error == "skip" and pool.backend != "processes":
        raise ValueError(f"on_error='skip' needs backend='processes' (worker processes on this "
                         f"host), got backend={pool.backend!r}; a replacing on_error=callable works "
                         "with any backend")
    if spec.on_error != "raise" and kind not in (SAMPLE, BATCH_CALLABLE):
        raise ValueError(
            f"on_error={spec.on_error!r} needs a callable source: an iterable or generator that "
            "raised cannot go on from where it was")
    if spec.hooks.batch_info and kind != BATCH_CALLABLE:
        raise ValueError("hooks.batch_info=True needs a callable source (not an iterable or generator)")
    return kind


def _refilled(spec: SourceSpec) -> SourceSpec:
    """The spec the producer works to. With ``on_error="skip"`` the refill
    (:mod:`extsrc.engine.refill`) holds one workers' batch beyond those the consumer holds (the
    one it is handing out in parts), so the source keeps a slot more for it, rather than make
    a new one per batch; and ``last_batch="drop"`` is the refill's, the producer hands out
    every sample."""
    if spec.on_error != "skip":
        return spec
    engine = copy.copy(spec)  # the spec is frozen and checked; these two values stay valid
    object.__setattr__(engine, "batches_held", spec.batches_held + 1)
    if spec.last_batch == "drop":
        object.__setattr__(engine, "last_batch", "partial")
    return engine


def _parse_refill(state: Dict[str, Any], batch_size: int) -> Tuple[int, Dict[int, int], int]:
    """``(batches handed out, {batch: good samples handed out}, batches to make again and
    drop)`` of a state's ``refill``."""
    refill = state.get("refill", {})
    expected = ("set_state: 'refill' must be {'given': int >= 0, 'carry': [[batch, count], ...], "
                "'discard': int >= 0} "
                f"with 0 < count < batch_size={batch_size} and each batch at or after the state's "
                f"iteration, as get_state() makes it; got {refill!r}")
    try:
        given, discard = refill.get("given", 0), refill.get("discard", 0)
        pairs = [(i, n) for i, n in refill.get("carry", ())]
    except (AttributeError, TypeError, ValueError):
        raise ValueError(expected) from None
    iteration = state.get("iteration", 0)
    if not is_int(given) or given < 0 or not is_int(discard) or discard < 0 or not all(
            is_int(i) and is_int(n) and i >= iteration and 0 < n < batch_size for i, n in pairs):
        raise ValueError(expected)
    return given, {int(i): int(n) for i, n in pairs}, discard


def _parse_count(state: Dict[str, Any], key: str) -> int:
    value = state.get(key, 0)
    if not is_int(value) or value < 0:
        raise ValueError(f"set_state: {key} must be an int >= 0, got {value!r}")
    return int(value)


def parse_state(state: object, caller: str = "set_state", saver: str = "get_state()") -> Tuple[int, ...]:
    """The epoch and iteration of a saved ``state``; ``ValueError`` naming ``caller`` if it is not
    a dict of two ints >= 0 (as ``saver`` returns them)."""
    expected = f"a dict {{'epoch_idx': int, 'iteration': int}} as returned by {saver}"
    if not isinstance(state, dict):
        raise ValueError(f"{caller} expects {expected}, got {type(state).__name__} {state!r}")
    missing = [k for k in ("epoch_idx", "iteration") if k not in state]
    if missing:
        raise ValueError(f"{caller} expects {expected}; {state!r} lacks {', '.join(missing)}")
    values = []
    for key in ("epoch_idx", "iteration"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{caller}: {key} must be an int >= 0, got {value!r}")
        values.append(int(value))
    return tuple(values)


def _parse_handed_out(state: Dict[str, Any], iteration: int) -> FrozenSet[int]:
    """The iterations after ``iteration`` a state says were handed out (``in_order=False``)."""
    given = state.get("handed_out", ())
    if not isinstance(given, (list, tuple)) or not all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i > iteration
            for i in given):
        raise ValueError(f"set_state: handed_out must be a list of iterations after iteration="
                         f"{iteration}, as get_state() gives it, got {given!r}")
    return frozenset(int(i) for i in given)


def raise_closed(name: str) -> None:
    from extsrc.errors import PoolClosedError

    raise PoolClosedError(f"source {name} is closed; no batches can be taken after close()")
