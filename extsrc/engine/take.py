"""The take: how ``next()`` hands a finished batch to exactly one caller, whatever interrupts it.

An exception can arrive at almost any point of ``next()``: a
``KeyboardInterrupt`` (a first or a second Ctrl-C), the exception of any
other signal's handler, a profiler's or a timeout's periodic signal. The take
is built so that there is nothing to undo when that happens. Its steps, in
the consumer's thread:

1. **Find** (pool lock held): the epoch's next batch is READY in its slot;
   decide what it becomes (a batch, a shorter last one, the end, an error).
   A batch that failed (its callback raised, or a sample was invalid) is taken
   as any other, and its hand-over raises its error: the epoch goes on with
   the next batch. Only the end of the data, the errors of
   :data:`~extsrc.errors.ENDS_EPOCH` (an order the callback's data falls
   short of, shared memory that cannot be had) and a fault of the pool end
   an epoch early.
2. **Prepare**: a :class:`~extsrc.shm.slots.Lease` over the slot's memory
   (lock held) and the batch's arrays over the lease (no lock). Nothing
   anyone else reads changes: an interrupt here drops what was prepared, and
   the batch is still READY for the next call.
3. **Commit** (lock held): checks that nothing moved meanwhile (the epoch,
   the slot and its lease sequence), then stores a :class:`Taken` record in
   the epoch. That one assignment is the commit point: from then on the batch
   belongs to the epoch's next hand-over, whoever does it.
4. **Apply** (lock held): the slot becomes LEASED to the record's lease, the
   producer forgets the batch, the epoch's cursor moves past it. Every step is
   an assignment made again when re-run, so a call that finds a record not yet
   handed over applies it again before anything else (:meth:`Taker.next`).
5. **Hand over**: the record is swapped out of the epoch and its batch
   returned.

Why steps 3 and 5 cannot be split: CPython runs signal handlers (and
switches threads) only at a function's start, a backward jump, or right after
a call into C. The commit point is a single store, and the hand-over
(``taken = epoch.taken; epoch.taken = None; return taken.outcome``) holds no
call, so a ``KeyboardInterrupt`` lands before it (the record stays, and the
next call returns it) or after the caller has the batch. Calling
``epoch.__next__()`` from a ``for`` loop keeps that promise up to the loop
variable; ``x = next(epoch)`` does not (the builtin ``next`` returns into C,
where an interrupt can discard its result), which is why extsrc's own layers
call ``__next__()``.

Threads: any consumer thread may apply or hand over a record; the swap in
step 5 gives it to exactly one of them.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Callable, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np

from extsrc.batch import Batch
from extsrc.engine.assembly import BatchOutput, Decision, Output, PendingBatch
from extsrc.errors import (ENDS_EPOCH, EmptyEpochError, EpochLengthError, EpochSupersededError,
                           SampleError, SharedMemoryError, SourceTimeoutError)
from extsrc.shm import limits
from extsrc.shm.slots import Lease

if TYPE_CHECKING:  # pragma: no cover
    from _thread import LockType as Waiter

    from extsrc.engine.pool import WorkerPool
    from extsrc.engine.producer import Producer, Run
    from extsrc.engine.spec import SourceSpec


class EpochState(enum.Enum):
    """Where an epoch stands.

    ::

        RUNNING ──last batch handed over──► LAST_GIVEN ──next call──► ENDED
           │                                                           ▲
           └── end of data, an error, close() ─────────────────────────┤
           └── a newer iter() or set_state() ──► SUPERSEDED ───────────┘ (raises on next())
    """

    RUNNING = "running"  # batches come
    LAST_GIVEN = "last given"  # the final (short) batch was handed out; the next call ends it
    SUPERSEDED = "superseded"  # a newer iter() or set_state() took the source over
    ENDED = "ended"  # StopIteration was raised, or the source was closed


class Taken:
    """A committed take (step 3): the batch (or its error), its lease and where the epoch goes
    after it."""

    __slots__ = ("pending", "lease", "outcome", "error", "iteration", "ends_epoch", "size", "asked_ns",
                 "ready_ahead")

    def __init__(self, pending: PendingBatch, lease: Lease, outcome: Optional[BatchOutput], size: int,
                 ends_epoch: bool, asked_ns: int, ready_ahead: int,
                 error: Optional[BaseException] = None):
        self.pending = pending
        self.lease = lease
        self.outcome = outcome  # None for a batch that failed: its hand-over raises `error`
        self.error = error
        self.iteration = pending.iteration
        self.ends_epoch = ends_epoch
        self.size = size
        self.asked_ns = asked_ns
        self.ready_ahead = ready_ahead


class Cursor:
    """Where handing items on in order stands: the first not handed on yet (``next``), and the
    later ones that were (``ahead``: out of order; entries below ``next`` mean nothing).

    Changed by single calls (``add``, ``discard``, one assignment), each complete or not made
    when an interrupt lands, so that :meth:`hand` may be called again for the same item.
    """

    __slots__ = ("next", "ahead")

    def __init__(self, first: int, ahead: Iterable[int] = ()):
        self.next = first
        self.ahead: Set[int] = set(ahead)
        self._skip_ahead()

    def hand(self, iteration: int) -> None:
        """Item ``iteration`` was handed on; idempotent."""
        if iteration > self.next:
            self.ahead.add(iteration)
            return
        if iteration == self.next:
            self.next = iteration + 1
        self._skip_ahead()  # also when called again: an interrupt may have cut it short

    def handed_out(self) -> List[int]:
        """The items after ``next`` handed on already, ascending."""
        return sorted(i for i in self.ahead if i > self.next)

    def _skip_ahead(self) -> None:
        # each step moves the cursor, then forgets the entry passed: an entry left behind by an
        # interrupt means nothing
        while self.next in self.ahead:
            passed = self.next
            self.next = passed + 1
            self.ahead.discard(passed)


def first_ready(pool: "WorkerPool", epochs: Sequence["Epoch"], timeout: Optional[float]) -> "Epoch":
    """The first of ``epochs`` (of sources of ``pool``) whose ``next()`` returns or raises at
    once, waiting for one as long as needed; past ``timeout`` seconds, the first of them, whose
    own wait raises the timeout naming what is stuck. Consumer thread, lock not held."""
    waited = 0.0
    while True:
        with pool.lock:
            waiter = pool.waiter()  # taken before looking: a change after it releases it
        ready = next((epoch for epoch in epochs if epoch.ready()), None)
        if ready is not None:
            return ready
        if timeout is not None and waited >= timeout:
            return epochs[0]
        started = time.monotonic()
        pool.wait(waiter, None if timeout is None else timeout - waited)
        waited += time.monotonic() - started


class Epoch:
    """The iterator of one epoch of a source, what ``iter(source)`` returns.

    Its state (:class:`EpochState`) and cursor change only with the pool's
    lock held, through the :class:`Taker` of its source. ``taken`` is a batch
    committed and not yet handed over (see the module doc).
    """

    def __init__(self, taker: "Taker", run: "Run"):
        self.taker = taker
        self.run = run
        self.epoch_idx = run.epoch_idx
        # The first iteration not handed over yet, and those after it that were (in_order=False,
        # and those a resume skips).
        self.cursor = Cursor(run.first_iteration, run.skip)
        # Finished batches after next_yield that cannot be made (their error comes in place).
        self.in_place: FrozenSet[int] = frozenset()
        self.state = EpochState.RUNNING
        self.superseded_by = ""
        self.taken: Optional[Taken] = None
        self.last_given = -1  # the iteration of the batch handed over last (-1: none yet)

    def __iter__(self) -> "Epoch":
        return self

    def __next__(self) -> BatchOutput:
        return self.taker.next(self)

    def position(self) -> Tuple[int, List[int]]:
        """Where the epoch stands (lock held): the first iteration not handed over yet, and
        the later ones that were (``in_order=False``), ascending."""
        taken = self.taken
        given = {i for i in self.ahead if i >= self.next_yield}
        if taken is None:
            return self.next_yield, sorted(given)
        first = min(self.next_yield, taken.iteration)
        # Every iteration before next_yield was handed over, but the record's.
        given.update(range(first + 1, self.next_yield))
        given.discard(taken.iteration)
        return first, sorted(given)

    def goes_on(self) -> bool:
        """Whether ``__next__()`` may still give batches: not ended by an error, the end of
        the data, ``close()`` or a newer loop."""
        return self.state in (EpochState.RUNNING, EpochState.LAST_GIVEN)

    def ready(self) -> bool:
        """Whether ``__next__()`` would return or raise at once rather than wait (any
        consumer thread; no state changes): to serve several epochs as their batches come."""
        taker = self.taker
        producer, pool = taker.producer, taker.pool
        with pool.lock:
            pool.notice_io_end()
            if (self.taken is not None or self.state is not EpochState.RUNNING
                    or self is not taker.current or pool.broken or pool.closed):
                return True
            batches = taker.spec.batches_per_epoch
            if batches is not None and self.next_yield >= batches:
                return True
            if (producer.ready(self.run, self.next_yield) is not None
                    or producer.failure(self.run, self.next_yield) is not None):
                return True
            return not taker.spec.in_order and taker.whole_ahead(self) is not None

    def may_take(self, iteration: int) -> bool:
        """Whether batch ``iteration`` is still to be handed over (lock held)."""
        if iteration == self.next_yield:
            return True
        return (not self.taker.spec.in_order and iteration > self.next_yield
                and iteration not in self.ahead)

    @property
    def next_yield(self) -> int:
        """The first iteration not handed over yet."""
        return self.cursor.next

    @property
    def ahead(self) -> Set[int]:
        """Iterations after :attr:`next_yield` handed over already; entries below it mean nothing."""
        return self.cursor.ahead


class Taker:
    """The consumer's side of one source: takes its batches epoch by epoch (see the module doc).

    Called from consumer threads only; every state change happens with the
    pool's lock held. ``name`` names the source in errors.
    """

    def __init__(self, pool: "WorkerPool", producer: "Producer", spec: "SourceSpec", name: str,
                 report: Optional[Callable[[], None]] = None):
        self.pool = pool
        self.report = report  # called after each batch counted in the statistics (stats_every=)
        self.producer = producer
        self.spec = spec
        self.name = name
        self.current: Optional[Epoch] = None

    # -- epochs (lock held) ----------------------------------------------------------------------

    def begin(self, run: "Run") -> Epoch:
        """A new epoch producing ``run``; the running one (if any) is superseded."""
        self.supersede("a newer iter() on the same source")
        epoch = Epoch(self, run)
        self.current = epoch
        return epoch

    def supersede(self, why: str) -> None:
        """Ends the running epoch for good: its next ``next()`` raises
        :class:`~extsrc.errors.EpochSupersededError` naming ``why``."""
        epoch, self.current = self.current, None
        if epoch is not None and epoch.state in (EpochState.RUNNING, EpochState.LAST_GIVEN):
            epoch.superseded_by = why
            epoch.state = EpochState.SUPERSEDED
        if epoch is not None:
            epoch.taken = None  # its lease returns the slot when dropped

    def close(self) -> None:
        """Ends the running epoch quietly (``close()``): its next ``next()`` raises StopIteration."""
        epoch, self.current = self.current, None
        if epoch is not None:
            epoch.state = EpochState.ENDED
            epoch.taken = None

    def end(self, epoch: Epoch) -> None:
        """Ends ``epoch`` (its data is over, or an error): production stops."""
        epoch.state = EpochState.ENDED
        if self.current is epoch:
            self.producer.request(None)

    # -- the take ----------------------------------------------------------------------------------

    def next(self, epoch: Epoch) -> BatchOutput:
        """The epoch's next batch (see the module doc for the steps); raises StopIteration at
        its end, the batch's error, :class:`~extsrc.errors.SourceTimeoutError`, or
        :class:`~extsrc.errors.EpochSupersededError` when another loop took the source over."""
        pool, producer = self.pool, self.producer
        pool.check_owner()
        stats = producer.stats
        asked = time.perf_counter_ns() if stats is not None else 0
        timeout = self.spec.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            lease: Optional[Lease] = None
            waiter: Optional["Waiter"] = None
            pending: Optional[PendingBatch] = None
            # 1. Find (or apply a record committed by a call that did not get to hand it over).
            with pool.lock:
                if epoch.taken is not None:
                    self._apply(epoch)
                else:
                    pending, waiter = self._ready_or_waiter(epoch, deadline)
                    if pending is not None:
                        decision = self._counted(epoch, pending, self._decide(epoch, pending))
                        ready = producer.ready_count() - 1 if stats is not None else 0
                        # 2. Prepare (the lease; the arrays below, without the lock).
                        lease = producer.slots.lease(pending.slot, pending.overflow_sizes(decision.size))
            if waiter is not None:
                # Waiting happens outside the lock (see extsrc.engine.pool).
                pool.wait(waiter, None if deadline is None else deadline - time.monotonic())
                continue
            if lease is None:
                # 5. Hand over a record committed before: no call from the swap to the return.
                taken = epoch.taken
                epoch.taken = None
                if taken is None:
                    continue  # another thread handed it over, or it was dropped
                epoch.last_given = taken.iteration
                error = taken.error
                if error is None:
                    return taken.outcome  # type: ignore[return-value]  # a record without error has one
                taken = pending = None  # nothing of this frame may keep the error (see _decide)
                try:
                    raise error
                finally:
                    error = None
            assert lease is not None and pending is not None
            error = decision.error
            outcome: Optional[BatchOutput] = None
            if error is None:
                try:
                    outcome = self._finish(pending.build(lease, decision.size, producer.num_outputs,
                                                         self.spec.hooks.dense_arrays))
                except (SampleError, SharedMemoryError) as exc:
                    with pool.lock:
                        early = pending.iteration > epoch.next_yield
                        if early:  # taken early (in_order=False): its error comes in its place
                            epoch.in_place = epoch.in_place | {pending.iteration}
                        elif isinstance(exc, ENDS_EPOCH):
                            if epoch.state is EpochState.RUNNING and epoch.next_yield == pending.iteration:
                                self.end(epoch)  # no memory for the batch: the epoch ends with it
                            raise
                    if early:
                        continue
                    error = exc  # the batch cannot be made: its error is handed over in its place
            record = Taken(pending, lease, outcome, decision.size, decision.ended, asked, ready, error)
            error = None
            del decision  # no local but the record's may hold a batch's error (see _decide)
            with pool.lock:
                # 3. Commit, if nothing moved since step 1; else find again.
                if (epoch.state is not EpochState.RUNNING or epoch.taken is not None
                        or not epoch.may_take(pending.iteration) or producer.run is not epoch.run
                        or not producer.slots.holds(pending.slot, pending.seq, lease)):
                    continue
                epoch.taken = record
                # 4. Apply.
                self._apply(epoch)
            if stats is not None and outcome is not None:
                stats.took(record.size, _nbytes(outcome), time.perf_counter_ns() - record.asked_ns,
                           record.ready_ahead, record.iteration == epoch.run.first_iteration)
                if self.report is not None:
                    self.report()
            # 5. Hand over: no call from the swap to the return.
            taken = epoch.taken
            epoch.taken = None
            if taken is None:
                continue  # another thread handed it over while this one counted it
            epoch.last_given = taken.iteration
            error = taken.error
            if error is None:
                return taken.outcome  # type: ignore[return-value]  # a record without error has one
            taken = pending = lease = outcome = None  # see _decide
            del record
            try:
                raise error
            finally:
                error = None

    def _apply(self, epoch: Epoch) -> None:
        """Step 4 for ``epoch.taken`` (lock held); idempotent. A record whose slot no longer holds
        its batch (the epoch was superseded meanwhile) is dropped."""
        taken = epoch.taken
        if taken is None:
            return
        pending, producer = taken.pending, self.producer
        if not producer.slots.holds(pending.slot, pending.seq, taken.lease):
            epoch.taken = None
            return
        producer.slots.commit(pending.slot, taken.lease)
        producer.commit(pending)
        ahead = taken.iteration > epoch.next_yield  # handed out ahead (in_order=False)
        epoch.cursor.hand(taken.iteration)  # idempotent: also when re-run after an interrupt
        if taken.ends_epoch and not ahead:
            epoch.state = EpochState.LAST_GIVEN

    # -- finding the batch (lock held) -------------------------------------------------------------

    def _ready_or_waiter(self, epoch: Epoch, deadline: Optional[float]
                         ) -> Tuple[Optional[PendingBatch], Optional["Waiter"]]:
        """``(batch, None)``: the batch to hand out next, finished (the epoch's next one,
        or with ``in_order=False`` the earliest whole one after it); else ``(None, waiter)``,
        a waiter to wait on.

        Raises ``StopIteration`` at the end of the epoch, the pool's fault, a
        failed dispatch, :class:`SourceTimeoutError` past ``deadline``.
        """
        pool, producer = self.pool, self.producer
        if epoch.state is EpochState.SUPERSEDED:
            raise EpochSupersededError(
                f"this loop over source {self.name} (epoch {epoch.epoch_idx}) was ended by "
                f"{epoch.superseded_by} before its end: a source serves one loop at a time, and "
                "two loops (or loaders) over one source would each get only some of the batches. "
                "Finish or leave a loop before starting the next, or make a source per loop"
            )
        if epoch.state is EpochState.LAST_GIVEN:
            self.end(epoch)
            raise StopIteration
        if epoch.state is EpochState.ENDED or epoch is not self.current:
            raise StopIteration  # closed
        batches = self.spec.batches_per_epoch
        if batches is not None and epoch.next_yield >= batches:
            self.end(epoch)
            raise StopIteration  # the order's epoch is over
        pool.check_usable(producer.source_id)
        pending = producer.ready(epoch.run, epoch.next_yield)
        if pending is not None:
            return pending, None
        if not self.spec.in_order:
            later = self.whole_ahead(epoch)
            if later is not None:
                return later, None
        failure = producer.failure(epoch.run, epoch.next_yield)
        if failure is not None:
            self.end(epoch)
            try:
                raise failure
            finally:
                failure = None  # see _decide
        if deadline is not None and deadline - time.monotonic() <= 0:
            raise self._timed_out(epoch)
        return None, pool.waiter()

    def whole_ahead(self, epoch: Epoch) -> Optional[PendingBatch]:
        """The earliest finished batch after the epoch's next one that was not handed out and
        is whole, for ``in_order=False`` (lock held): a short last batch, the end of the epoch
        and a batch's error come in their place."""
        for later in self.producer.ready_after(epoch.run, epoch.next_yield):
            if later.iteration not in epoch.ahead and later.iteration not in epoch.in_place:
                decision = later.decide(self.spec.last_batch, self.name)
                if decision.error is None and not decision.ended and decision.size:
                    return later
        return None

    def _decide(self, epoch: Epoch, pending: PendingBatch) -> Decision:
        """What the ready batch becomes: a batch, or the error its hand-over raises; raises at
        the end of the epoch, and for an error that ends it (:data:`~extsrc.errors.ENDS_EPOCH`)."""
        decision = pending.decide(self.spec.last_batch, self.name)
        if (decision.ended and decision.error is None
                and any(i >= pending.iteration + (decision.size > 0) for i in epoch.ahead)):
            self.end(epoch)
            raise EpochLengthError(
                f"source {self.name}: the callback ended epoch {epoch.epoch_idx} at batch "
                f"{pending.iteration}, and batch(es) "
                f"{sorted(i for i in epoch.ahead if i >= pending.iteration)} after it were "
                "already handed out (in_order=False takes a finished whole batch before earlier "
                "ones): the callback must end the epoch at every sample past its end, as one "
                "over a sequence does, or the source needs an order= that knows the epoch's length")
        if decision.error is None and decision.size:
            return decision
        if decision.error is not None and not isinstance(decision.error, ENDS_EPOCH):
            return decision  # raised in its place by the hand-over; the epoch goes on
        self.end(epoch)
        if decision.error is not None:
            error = decision.error
            # The error's traceback holds this frame (and its callers'): no local of it may
            # hold the error, else the cycle keeps those frames, and the DALI pipeline or loop
            # in them, alive (its workers running) until the garbage collector runs.
            del decision, pending
            try:
                raise error
            finally:
                del error
        if decision.produced and epoch.next_yield == 0 and epoch.run.first_iteration == 0:
            raise EmptyEpochError(
                f"source {self.name}: epoch {epoch.epoch_idx} ended after {decision.produced} "
                f"samples, fewer than batch_size={self.spec.batch_size}, and "
                "last_batch='drop' dropped them all, so the epoch has no batch. Use "
                f"last_batch='partial', or a batch_size of at most {decision.produced}."
            )
        raise StopIteration

    def _counted(self, epoch: Epoch, pending: PendingBatch, decision: Decision) -> Decision:
        """``decision`` once the batch's skipped or replaced samples are counted: an error in
        its place past the source's ``max_errors``. A batch whose every sample was skipped is
        an empty one (the refill, :mod:`extsrc.engine.refill`, takes the next batch's)."""
        faults = pending.faults
        if not faults or decision.error is not None:
            return decision
        error: Optional[BaseException] = self.producer.faults.taken(pending.seq, epoch.epoch_idx, faults)
        return decision if error is None else decision._replace(error=error)

    def _finish(self, outcome: BatchOutput) -> BatchOutput:
        """Outputs that came uniform but spilled become one dense array: a copy, in private
        memory, of the first batch only (until then the workers cannot know the output's
        layout, so each wrote its samples to its own overflow area), so that every batch of
        a uniform output is dense. Raises :class:`SharedMemoryError` naming the copy when the
        process's memory limits leave no room for it."""
        outputs: Tuple[Output, ...]
        if isinstance(outcome, tuple):
            single, outputs = False, outcome
        else:
            single, outputs = True, (outcome,)
        if all(isinstance(samples, np.ndarray) or samples.is_dense or not samples
               for samples in outputs):
            return outcome
        stacked = {j for j, samples in enumerate(outputs) if not isinstance(samples, np.ndarray)
                   and not samples.is_dense and len(samples) > 1 and _uniform(samples)}
        if stacked:
            # The limits are read once for all the copies: a sample of thousands of leaves
            # read the cgroup files thousands of times per first batch (about 1 ms each).
            nbytes = sum(s.nbytes for j in stacked for s in outputs[j])
            named = f"output {min(stacked)}" if len(stacked) == 1 else f"{len(stacked)} outputs"
            error = limits.copy_error(nbytes, self._copy_what(named))
            if error is not None:
                raise error
        finished: List[Output] = []
        for j, samples in enumerate(outputs):
            if isinstance(samples, np.ndarray):
                finished.append(samples)
                continue
            if not samples.is_dense and len(samples) == 1:
                samples = Batch(dense=samples[0][np.newaxis])  # one sample: a view, no copy
            elif j in stacked:
                try:
                    # dtype given: np.stack alone gives native byte order ('>f8' became '<f8')
                    samples = Batch(dense=np.stack(samples, dtype=samples[0].dtype))
                except MemoryError as exc:
                    raise limits.copy_error(sum(s.nbytes for s in samples),
                                            self._copy_what(f"output {j}"), exc) from None
            finished.append(samples.as_array() if samples.is_dense and self.spec.hooks.dense_arrays
                            else samples)
        return finished[0] if single else tuple(finished)

    def _copy_what(self, named: str) -> str:
        """What :meth:`_finish` copies, for its errors: ``named`` says which outputs."""
        return (f"a dense copy of {named} of a batch of source {self.name} (its samples were "
                "written apart, as in a source's first batch, before the output's layout is known)")

    def _timed_out(self, epoch: Epoch) -> SourceTimeoutError:
        producer, pool = self.producer, self.pool
        stuck = []
        pending = producer.pending.get(epoch.next_yield)
        rows = pool.running_tasks(producer.source_id)
        # The batch's own tasks, and what the workers holding them are running instead.
        holding = {worker for worker, _, task, _ in rows if pending is None or task.batch_seq == pending.seq}
        for worker, described, task, running in rows:
            if pending is None or task.batch_seq == pending.seq or (worker in holding and running):
                state = f"running for {running:.1f} s" if running else "queued behind another task"
                stuck.append(f"{described}: {producer.describe_task(task)}, {state}")
        others = pool.other_work(producer.source_id)  # on a shared pool: what was ahead
        if not stuck:
            stuck = ["none of its tasks had reached a worker" if others else "no task was running"]
        ahead = f". Other sources' tasks ahead of it: {'; '.join(others)}" if others else ""
        error = SourceTimeoutError(
            f"batch {epoch.next_yield} of epoch {epoch.epoch_idx} of source {self.name} was not "
            f"ready after timeout={self.spec.timeout} s. Stuck: " + "; ".join(stuck) + ahead
            + ". The workers were shut down.",
            timeout=self.spec.timeout,
        )
        pool.fail(error)
        pool.check_usable(producer.source_id)  # marks it as reported
        return error


def _nbytes(outcome: BatchOutput) -> int:
    outputs = outcome if isinstance(outcome, tuple) else (outcome,)
    total = 0
    for samples in outputs:
        if isinstance(samples, np.ndarray):
            total += samples.nbytes
        else:
            total += samples.as_array().nbytes if samples.is_dense else sum(s.nbytes for s in samples)
    return total


def _uniform(samples: Batch) -> bool:
    first = samples[0]
    return all(s.shape == first.shape and s.dtype == first.dtype for s in samples)
