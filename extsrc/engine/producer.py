"""Producing a source's batches: which batch goes where, and what came back.

A :class:`Producer` is a source's side of the pool (a
:class:`~extsrc.engine.pool.PoolClient`). It owns the source's slots
(:class:`~extsrc.shm.slots.SlotPool`), the layouts learned so far, and the
batches in production. All of that changes in the pool's I/O thread only:

* the consumer asks for a *run* (an epoch from a given iteration) by
  setting :attr:`Producer.requested` (one assignment) and waking the pool;
* the I/O thread, in :meth:`service`, switches to the requested run
  (abandoning the batches of the previous one), takes back memory of
  batches the consumer dropped, and dispatches batches into free slots,
  ``prefetch`` ahead; in :meth:`on_result` it records what workers wrote;
* the consumer takes finished batches (:meth:`ready`, :meth:`commit`) with
  the lock held and never changes anything else, so an interrupt in the
  consumer thread cannot leave production half done.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
import pickle
import warnings
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Set, Tuple

from extsrc.engine import policy
from extsrc.engine.faults import FaultLedger, budget
from extsrc.engine.assembly import PendingBatch, rebuild_exception
from extsrc.engine.hooks import WorkerHooks
from extsrc.engine.kinds import BATCH_CALLABLE, SAMPLE, STREAMS, Source, SourceKind
from extsrc.engine.protocol import Result, SourceSetup, Task, TaskDone, TaskFailed
from extsrc.engine.spec import AUTO_OUTPUTS, SourceSpec
from extsrc.engine.stats import StatsCollector
from extsrc.errors import ENDS_EPOCH, OrderWarning, SampleError, SharedMemoryError, SourceTimeoutError
from extsrc.shm import limits
from extsrc.shm.layout import LayoutPlan, Region
from extsrc.shm.segment import backend
from extsrc.shm.slots import SlotPool, SlotState

if TYPE_CHECKING:
    from extsrc.engine.pickling import Pickler
    from extsrc.engine.pool import WorkerPool

# Failures that end the epoch at their batch (by their type's name, as a TaskFailed gives it).
_ENDS_EPOCH = frozenset(error.__qualname__ for error in ENDS_EPOCH)


class Run(NamedTuple):
    """One stretch of production: epoch ``epoch_idx`` from iteration ``first_iteration``, but
    for the iterations in ``skip`` (handed out before a resume, ``in_order=False``)."""

    run_id: int
    epoch_idx: int
    first_iteration: int
    skip: FrozenSet[int] = frozenset()


class Producer:
    """See the module docstring. Created by :class:`~extsrc.ParallelSource`."""

    def __init__(self, source: Source, kind: SourceKind, spec: SourceSpec, pool: WorkerPool,
                 name: Optional[str]):
        self.source = source
        self.kind = kind
        # A task may run again in another worker (a lost worker's): not an iterable's, whose
        # position lived in the lost worker.
        self.redoable = kind in (SAMPLE, BATCH_CALLABLE)
        self.spec = spec
        self.pool = pool
        self.source_id = pool.attach(self)
        self.name = name if name is not None else f"#{self.source_id}"
        self.pinned_worker = pool.pin_worker() if kind in STREAMS else None
        # As given, or the policy's default; then more once the batches turn out small.
        self.base_prefetch = spec.prefetch if spec.prefetch is not None else policy.default_prefetch(
            pool.num_workers, pool.max_outstanding, spec.concurrency)
        self.prefetch = self.base_prefetch
        self.widening_decided = spec.prefetch is not None  # small_prefetch was set (once)
        self.small_prefetch = self.base_prefetch  # the prefetch while the batches are small and short
        self.resting = False  # the prefetch was all made and waiting: topped up in one go (_rests)
        self.slots = SlotPool(self.source_id, f"source {self.name}", pool.num_workers,
                              self.base_prefetch + spec.batches_held, pool)
        self.layout = LayoutPlan(spec.outputs, spec.batch_size)
        self.requested: Optional[Run] = None  # set by the consumer thread
        self.run: Optional[Run] = None  # what the I/O thread produces
        self.pending: Dict[int, PendingBatch] = {}  # iteration -> batch of the run, not yet taken
        self.in_flight: Dict[int, PendingBatch] = {}  # ticket -> batch (abandoned ones too)
        self.next_dispatch = 0
        self.end_at: Optional[int] = None  # the run's epoch ends at this iteration
        self.error: Optional[Tuple[int, BaseException]] = None  # (iteration, dispatch failure)
        self._batch_seq = itertools.count()
        self._runs = itertools.count(1)
        self._closed = False
        self._ranges_last: Optional[List[Tuple[int, int]]] = None  # the last batch's tasks
        # Whether batches are cut into tasks (timing only ever cuts fewer): else each is one.
        self._cut = kind == SAMPLE and spec.hooks.assign is None and policy.task_ranges(
            spec.batch_size, pool.num_workers, self.base_prefetch) > 1
        local = pool.workers_backend.local_processes  # else no /proc of the workers to read
        self.notes: List[str] = []  # warnings from the workers, raised by the consumer (commit)
        self._noted: Set[str] = set()  # each once
        self.faults = FaultLedger(self.name, budget(
            spec.max_errors, None if spec.order is None else len(spec.order)))
        self.stats = (StatsCollector(pool.num_workers, pool.worker_pids if local else None,
                                     spec.concurrency)
                      if spec.collects_stats else None)

    @property
    def num_outputs(self) -> Optional[int]:
        """Outputs per sample: as declared (``None``: one array), or, with
        ``num_outputs="auto"``, as learnt from the first results (0 until then)."""
        if isinstance(self.spec.num_outputs, str):  # AUTO_OUTPUTS
            return self.layout.num_outputs
        return self.spec.num_outputs

    # -- consumer thread, lock held ----------------------------------------------------------

    def request(self, epoch_idx: Optional[int], first_iteration: int = 0,
                skip: FrozenSet[int] = frozenset()) -> Optional[Run]:
        """Asks for a new run (``None``: stop producing); the I/O thread switches to it."""
        run = None if epoch_idx is None else Run(next(self._runs), epoch_idx, first_iteration, skip)
        self.requested = run
        self.pool.wake()
        return run

    def ready(self, run: Run, iteration: int) -> Optional[PendingBatch]:
        """The batch ``iteration`` of ``run`` if every task of it reported back."""
        if self.run is not run:
            return None
        pending = self.pending.get(iteration)
        return pending if pending is not None and pending.complete else None

    def ready_after(self, run: Run, iteration: int) -> List[PendingBatch]:
        """The finished batches of ``run`` after ``iteration`` that lie before the epoch's end
        as known so far, earliest first (``in_order=False``)."""
        if self.run is not run:
            return []
        end = self.end_at
        return sorted((p for i, p in self.pending.items()
                       if i > iteration and p.complete and (end is None or i < end)),
                      key=lambda p: p.iteration)

    def failure(self, run: Run, iteration: int) -> Optional[BaseException]:
        """Why batch ``iteration`` of ``run`` could not be dispatched, if it could not."""
        if self.run is run and self.error is not None and self.error[0] == iteration:
            return self.error[1]
        return None

    def ready_count(self) -> int:
        """Batches finished and not taken yet (their slots are READY; consumer, lock held)."""
        return self.slots.ready

    def commit(self, pending: PendingBatch) -> None:
        """The consumer took ``pending`` (its slot is LEASED). Raises the workers' warnings
        (:class:`~extsrc.errors.OrderWarning`), each once."""
        self.pending.pop(pending.iteration, None)
        if pending.spilled and all(r is not None for r in self.layout.regions()[0]):
            # Its overflow held the samples of a layout learned since (the first batch):
            # give that memory back once the batch is dropped.
            pending.slot.retire_when_free = True
        # While production rests (_rests), the I/O thread need not look before the mark.
        resting = self.resting and self.slots.ready > (policy.resume_mark(self.prefetch) or 0)
        if not resting and (len(self.pending) - self.slots.ready < self.pool.num_workers
                            or self.pool.has_idle_worker()):
            # One batch fewer ahead: dispatch the next now. With a task per worker or more
            # still being made, and every worker holding one, the next answer wakes the I/O
            # thread anyway (a wake-up, a system call and a thread switch fewer per batch); a
            # worker with nothing to do must not wait for another's slow task to answer.
            self.pool.wake()
        while self.notes:
            note = self.notes.pop(0)
            if note not in self._noted:
                self._noted.add(note)
                warnings.warn(note, OrderWarning, stacklevel=2)

    def uncommit(self, pending: PendingBatch) -> None:
        """Undoes :meth:`commit` (the take was interrupted)."""
        self.pending[pending.iteration] = pending

    # -- I/O thread, lock held (the PoolClient protocol) ---------------------------------------

    def worker_source(self, pickler: Optional[Pickler]) -> SourceSetup:
        callback: object = self.source  # as it is (fork), or pickled
        on_error = None if self.spec.on_error == "raise" else self.spec.on_error
        hooks = replace(self.spec.hooks.in_workers, on_error=on_error)
        carried = (hooks.worker_init, hooks.begin_epoch, hooks.on_error)  # sent with the callback
        hooks_pickled = False
        if pickler is not None:
            if all(c is None or isinstance(c, str) for c in carried):
                callback = pickler.dumps(self.source, what=f"source {self.name}")
            else:  # together, so that objects they share stay shared in the worker
                callback = pickler.dumps((self.source, *carried), what=f"source {self.name}")
                hooks, hooks_pickled = WorkerHooks(batch_info=hooks.batch_info), True
        o = self.spec
        return SourceSetup(
            source_id=self.source_id, name=self.name, kind=self.kind, callback=callback,
            pickled=pickler is not None, batch_size=o.batch_size, num_outputs=o.num_outputs,
            dtypes=tuple(None if d is None else d.str for d in o.dtypes),
            ndims=o.ndims, order=o.order, last_batch=o.last_batch, in_place=o.in_place,
            timed=o.collects_stats, slots_kept=self.base_prefetch + o.batches_held,
            concurrency=o.concurrency, timeout=o.timeout,
            hooks=hooks, hooks_pickled=hooks_pickled, num_workers=self.pool.num_workers,
        )

    def on_result(self, message: Result) -> bool:
        pending = self.in_flight.pop(message.ticket, None)
        if pending is None:
            return False
        if (isinstance(message, TaskDone) and message.samples
                and self.spec.num_outputs == AUTO_OUTPUTS):
            message = self._check_outputs(pending, message)
        pending.add(message)
        if pending.complete:
            self.slots.filled(pending.slot)
            self.slots.fit_overflow(pending.slot, pending.overflow_use())
        if isinstance(message, TaskDone):
            if self.stats is not None:
                self.stats.task_done(message.worker, message.busy_ns, message.timed,
                                     message.waited_ns, message.cpu_ns, message.runq_ns)
            if message.notes:
                self.notes.extend(message.notes)
            if message.samples:
                self._learn(pending, message)
            if message.stopped and self.run is not None and pending is self.pending.get(pending.iteration):
                self.end_at = pending.iteration if self.end_at is None else min(self.end_at, pending.iteration)
        elif isinstance(message, TaskFailed) and message.type_name == SourceTimeoutError.__qualname__ \
                and not self.pool.broken and pending is self.pending.get(pending.iteration):
            # A sample hung past the timeout (samples in flight together): as for a batch the
            # consumer found too slow, the workers are shut down (a hung thread cannot be stopped).
            self.pool.fail(rebuild_exception(message, self.name))
            return True
        elif (isinstance(message, TaskFailed) and message.type_name in _ENDS_EPOCH
              and pending is self.pending.get(pending.iteration)):
            # The callback's data ended before the order's, or the source's memory cannot be
            # had: the epoch ends there. Any other failure fails its batch alone (its error is
            # raised in its place, extsrc.engine.take).
            self.end_at = pending.iteration if self.end_at is None else min(self.end_at, pending.iteration)
        return pending.complete

    def service(self) -> bool:
        if self._closed:
            return False
        if self.slots.returns:
            self.slots.process_returns()
        if self.requested is not self.run:
            self._switch(self.requested)
        failed = self.error
        self._fill()
        self.slots.trim()
        return self.error is not failed

    def lends(self) -> bool:
        return not self._closed and bool(self.slots.leases)  # once closed, returns are not applied

    def describe_task(self, task: Task) -> str:
        if self.kind == SAMPLE:
            base = task.iteration * self.spec.batch_size
            return (
                f"samples {task.start}..{task.stop - 1} of batch {task.iteration} of epoch "
                f"{task.epoch_idx} (idx_in_epoch {base + task.start}..{base + task.stop - 1}) "
                f"of source {self.name}"
            )
        return f"batch {task.iteration} of epoch {task.epoch_idx} of source {self.name}"

    def on_pool_closed(self) -> None:
        self.close(tell_workers=False)

    # -- production ----------------------------------------------------------------------------

    def _switch(self, run: Optional[Run]) -> None:
        """Abandons the current run's batches and starts ``run``."""
        for pending in self.pending.values():
            self.slots.abandon(pending.slot)  # READY -> FREE, FILLING -> DRAINING
        for task in self.pool.discard_queued(self.source_id):
            batch = self.in_flight.pop(task.ticket, None)
            if batch is not None:
                batch.cancel(task.ticket)  # never sent: nothing will come for it
                if batch.complete and batch.slot.state is SlotState.DRAINING:
                    # Nothing else gives its slot back: a batch of this run, or one left at an
                    # earlier switch whose task was queued again (its worker lost).
                    self.slots.filled(batch.slot)
        self.pending.clear()
        self.run = run
        self.next_dispatch = 0 if run is None else run.first_iteration
        self.end_at = None
        self.error = None
        self.resting = False

    def _fill(self) -> None:
        run = self.run
        if run is None or self.error is not None:
            return
        o = self.spec
        if self._rests():
            return
        while self._room_ahead():
            if not self.layout.known and len(self.pending) >= self.pool.num_workers:
                # The first results tell the layouts; until then a batch per worker at most (their
                # samples go to overflow), so that workers that wait for each other all get work.
                return
            while self.next_dispatch in run.skip:
                self.next_dispatch += 1
            iteration = self.next_dispatch
            if self.end_at is not None and iteration > self.end_at:
                return
            limit = o.batches_per_epoch
            if limit is not None and iteration >= limit:
                return  # an order knows where the epoch ends
            regions, region_bytes = self.layout.regions()
            if o.prefetch is None:
                if not self.widening_decided:
                    self._widen_for_small(regions, region_bytes)
                self.prefetch = (self.small_prefetch if self.pool.tasks_short(self.source_id)
                                 else self.base_prefetch)
            seq = next(self._batch_seq)
            try:
                slot = self.slots.acquire(region_bytes, self._total_need(region_bytes), seq)
            except SharedMemoryError as exc:
                if exc.errno in limits.DESCRIPTOR_ERRNOS and self.pending:
                    return  # out of descriptors: go on with the slots there are, try again later
                base = self.base_prefetch
                if self.prefetch > base and len(self.pending) >= base:
                    # No memory for a batch beyond the prefetch asked for (the small-batch
                    # widening, a convenience): the prefetch stays where it got, nothing fails.
                    self.prefetch = self.small_prefetch = max(base, len(self.pending))
                    return
                self.error = (iteration, limits.with_advice(exc, backend(),
                                                            self._total_need(region_bytes)))
                return
            pending = PendingBatch(seq, run.epoch_idx, iteration, slot, regions)
            tasks = []
            for start, stop in self._ranges():
                ticket = self.pool.new_ticket()
                pending.expect(ticket, start, stop)
                self.in_flight[ticket] = pending
                tasks.append(Task(self.source_id, ticket, slot.slot_id, pending.seq, run.epoch_idx,
                                  iteration, start, stop, region_bytes, not self.slots.watched,
                                  regions))
            self.pending[iteration] = pending
            self.next_dispatch += 1
            assign = o.hooks.assign
            worker = (self.pinned_worker if assign is None or self.pinned_worker is not None
                      else self._assigned(assign, iteration))
            for task in tasks:
                self.pool.submit(task, worker)

    def _widen_for_small(self, regions: Tuple[Optional[Region], ...], region_bytes: int) -> None:
        """With the default prefetch, once every output's layout is known, the prefetch for
        small batches (:func:`extsrc.engine.policy.small_batch_prefetch`). Decided once, when
        the layout is first known; used while the pool finds the source's tasks short."""
        if not regions or any(r is None for r in regions):
            return
        # Decided now, either way: the limits below are read from /proc and the cgroup files,
        # which at every dispatch took the I/O thread 600-700 us per batch of 1.5 MiB.
        self.widening_decided = True
        widened = policy.small_batch_prefetch(
            self.base_prefetch, region_bytes, self.spec.batches_held, self.pool.num_workers,
            limits.descriptor_limit(), limits.room_left())
        if widened is not None:
            self.small_prefetch = widened
            self.slots.keep_at_least(widened + self.spec.batches_held)

    def _assigned(self, assign: Callable[[int, int], Optional[int]], iteration: int) -> Optional[int]:
        """The worker ``hooks.assign`` gives batch ``iteration`` (None: any), checked."""
        workers = self.pool.num_workers
        worker = assign(iteration, workers)
        if worker is not None and (isinstance(worker, bool) or not isinstance(worker, int)
                                   or not 0 <= worker < workers):
            raise TypeError(f"source {self.name}: hooks.assign({iteration}, {workers}) must return "
                            f"a worker index from 0 to {workers - 1}, or None, got {worker!r}")
        return worker

    def _rests(self) -> bool:
        """Whether production rests: it begins when every batch of the prefetch is finished and
        waiting (the consumer is the slower side), and ends once the consumer took enough of
        them to bring the ready ones down to :func:`extsrc.engine.policy.resume_mark`; the
        prefetch is then topped up in one go (see the policy for why)."""
        mark = policy.resume_mark(self.prefetch)
        ready = self.slots.ready
        if mark is None or len(self.pending) != ready:  # batches being made: production goes on
            self.resting = False
            return False
        self.resting = ready > mark if self.resting else ready >= self.prefetch
        return self.resting

    def _room_ahead(self) -> bool:
        """Whether another batch may be dispatched: fewer than ``prefetch`` are being made, and
        the slots in use (batches ahead, and those the consumer holds) stay within the
        ``prefetch + batches_held`` the source keeps. A finished batch the consumer has not
        taken yet thus takes no worker's place while the consumer holds fewer than
        ``batches_held``: the workers keep a task queued instead of waiting for the take."""
        ahead = len(self.pending)
        slots = self.slots
        if ahead and slots.waits_for_drain:
            # At an epoch's turnover, the last one's abandoned batches drain while the new one's
            # are dispatched: a batch made now would retire a held slot for new memory, each
            # epoch. It waits for a drained slot instead (one batch ahead at least: no hang).
            return False
        if ahead < self.prefetch:
            return True
        return ahead - slots.ready < self.prefetch and ahead + slots.held < slots.keep

    def _ranges(self) -> List[Tuple[int, int]]:
        """The samples of each task of the next batch: the whole batch (a batch callback,
        ``hooks.assign``: a batch to one worker, or a prefetch of twice the workers or more), or
        cut as :func:`extsrc.engine.policy.task_ranges` says for batches timed as the last."""
        ranges = self._ranges_last
        if ranges is None or self._cut:
            batch_size = self.spec.batch_size
            batch_seconds = self.pool.task_seconds(self.source_id) * len(ranges or ())
            parts = (policy.task_ranges(batch_size, self.pool.num_workers, self.base_prefetch,
                                        batch_seconds) if self._cut else 1)
            if ranges is None or len(ranges) != parts:
                bounds = [round(i * batch_size / parts) for i in range(parts + 1)]
                ranges = self._ranges_last = list(zip(bounds[:-1], bounds[1:]))
        return ranges

    def _total_need(self, region_bytes: int) -> int:
        return max(region_bytes, 1) * (self.slots.keep + 1)

    def _check_outputs(self, pending: PendingBatch, message: TaskDone) -> Result:
        """num_outputs="auto": learns the number of outputs from the first results; results
        of another number (another worker's samples) become the batch's error."""
        outputs = len(message.spilled)
        if not outputs and message.faults:
            return message  # every sample skipped before its outputs were known: nothing written
        if self.layout.num_outputs == 0:
            self.layout.widen(outputs)
            return message
        if outputs == self.layout.num_outputs:
            return message
        start = pending.ranges[message.ticket][0]
        error = SampleError(
            f"source {self.name}: the samples of worker {message.worker} from sample {start} of "
            f"batch {pending.iteration} (epoch {pending.epoch_idx}) on have {outputs} outputs, and "
            f"earlier samples had {self.layout.num_outputs} (num_outputs={AUTO_OUTPUTS!r}); every "
            "sample must have as many outputs"
        )
        return TaskFailed(message.source_id, message.ticket, message.worker, start, None,
                          pickle.dumps(error), "SampleError", str(error), "", False)

    def _learn(self, pending: PendingBatch, message: TaskDone) -> None:
        """Regions for later batches follow the layout of what the workers wrote."""
        for j, spilled in enumerate(message.spilled):
            if not spilled:
                continue  # everything in place: the layout holds
            first = spilled[0]
            uniform = all(s.dtype == first.dtype and s.shape == first.shape for s in spilled)
            if uniform and len(spilled) == message.samples:
                self.layout.learn(j, (first.dtype, tuple(first.shape)))
            else:
                self.layout.learn(j, None)

    # -- end -----------------------------------------------------------------------------------

    def close(self, tell_workers: bool) -> None:
        """Gives back the source's memory (held batches keep theirs). Lock held."""
        if self._closed:
            return
        self._closed = True
        if tell_workers:
            self._switch(None)
        self.pending.clear()
        self.in_flight.clear()
        self.slots.close(tell_workers)
