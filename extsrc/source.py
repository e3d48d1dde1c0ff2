"""``ParallelSource``: an epoch-level iterator over batches produced by a worker pool.

Life cycle of a batch:

1. *dispatch* (``_fill``): a free slot is taken from the source's
   :class:`~extsrc.slots.SlotRing`, region memory is reserved for the outputs
   whose shape is known, and the batch is split into sample ranges submitted
   to the pool as tasks;
2. *produce*: workers call the callback and write the samples into the slot
   (:mod:`extsrc.writer`);
3. *assemble* (:class:`~extsrc.assembly.PendingBatch`): when all its tasks
   reported back, the batch becomes zero-copy views, in index order;
4. *release*: the slot returns to the ring once the consumer has taken
   ``batches_held`` newer batches.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from extsrc.assembly import END_OF_EPOCH, PendingBatch
from extsrc.batch import Batch
from extsrc.errors import PoolClosedError, SharedMemoryError, SourceTimeoutError
from extsrc.messages import Region, Task, TaskDone, TaskFailed, sample_nbytes
from extsrc.pool import MAX_OUTSTANDING, WorkerPool
from extsrc.shm import align, backend, with_advice
from extsrc.slots import Slot, SlotRing
from extsrc.worker import BATCH_GENERATOR, BATCH_ITERABLE, SAMPLE, SourceSpec, classify

LAST_BATCH_POLICIES = ("drop", "partial")

BatchOutput = Union[Batch, Tuple[Batch, ...]]


def _per_output(value: Any, count: int, label: str) -> tuple:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{label} has {len(value)} entries for {count} outputs")
        return tuple(value)
    return (value,) * count


class _Epoch:
    """Iteration state of one epoch; the iterator ``iter(source)`` returns."""

    def __init__(self, source: "ParallelSource", epoch_idx: int, first_iteration: int):
        self.source = source
        self.epoch_idx = epoch_idx
        self.next_dispatch = first_iteration
        self.next_yield = first_iteration
        self.pending: Dict[int, PendingBatch] = {}  # iteration -> batch
        self.finished = False  # no more batches will be yielded
        self.last_was_partial = False

    def __iter__(self) -> "_Epoch":
        return self

    def __next__(self) -> BatchOutput:
        return self.source._next_batch(self)


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
    ``num_outputs`` of them. Its arrays are views of shared memory valid until
    ``batches_held`` newer batches were taken (default 2: while the consumer
    takes the next batch). Batches come in index order whatever the number of
    workers or their timing.

    The epoch ends when the callback raises ``StopIteration``:
    ``last_batch="drop"`` drops the batch in which it happened,
    ``"partial"`` yields the samples before it as a shorter final batch.

    Errors: an exception in the callback is raised from ``next()`` at its
    batch, with its type, message and worker traceback; an invalid sample
    raises :class:`~extsrc.errors.SampleError`; a dead worker
    :class:`~extsrc.errors.WorkerDiedError` and a batch slower than
    ``timeout`` seconds :class:`~extsrc.errors.SourceTimeoutError` (after
    those two the source is closed).

    ``dtype``/``ndim`` (one value, or one per output) declare what samples
    must be. Workers start on first use or at ``start()``; ``close()`` (or
    ``with``) stops them and frees all shared memory. ``pool`` shares one
    :class:`~extsrc.WorkerPool` between sources; then ``num_workers``,
    ``start_method`` and ``pickler`` come from the pool.
    """

    def __init__(
        self,
        source: Any,
        batch_size: int,
        *,
        num_outputs: Optional[int] = None,
        batch: bool = False,
        batch_info: bool = False,
        num_workers: int = 1,
        start_method: str = "fork",
        pickler: Any = None,
        prefetch: int = 2,
        last_batch: str = "drop",
        dtype: Any = None,
        ndim: Any = None,
        timeout: Optional[float] = None,
        batches_held: int = 2,
        pool: Optional[WorkerPool] = None,
        name: Optional[str] = None,
    ):
        self.kind = classify(source, batch)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if num_outputs is not None and (not isinstance(num_outputs, int) or num_outputs < 1):
            raise ValueError(f"num_outputs must be None or a positive int, got {num_outputs!r}")
        if last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be a positive int, got {prefetch!r}")
        if not isinstance(batches_held, int) or batches_held < 1:
            raise ValueError(f"batches_held must be a positive int, got {batches_held!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be None or a positive number of seconds, got {timeout!r}")
        if batch_info and self.kind != "callable":
            raise ValueError("batch_info=True needs batch=True and a callable (not iterable) source")
        outputs = 1 if num_outputs is None else num_outputs
        self.dtypes = tuple(None if d is None else np.dtype(d) for d in _per_output(dtype, outputs, "dtype"))
        self.ndims = _per_output(ndim, outputs, "ndim")
        if pool is None:
            pool = WorkerPool(num_workers, start_method, pickler)
            self._owns_pool = True
        else:
            if (num_workers, start_method, pickler) != (1, "fork", None):
                raise ValueError(
                    "num_workers, start_method and pickler come from the shared pool; "
                    "do not pass them together with pool="
                )
            self._owns_pool = False
        self.source = source
        self.batch_size = batch_size
        self.num_outputs = num_outputs
        self.batch_info = batch_info
        self.prefetch = prefetch
        self.last_batch = last_batch
        self.timeout = timeout
        self.batches_held = batches_held
        self._pool = pool
        self._id = pool._register(self)
        self.name = name if name is not None else f"#{self._id}"
        self._pinned_worker = pool._pin() if self.kind in (BATCH_ITERABLE, BATCH_GENERATOR) else None
        self._slots = SlotRing(f"source {self.name}", prefetch + batches_held, pool.num_workers)
        self._layouts: List[Optional[Tuple[str, Tuple[int, ...]]]] = [None] * outputs
        self._held: Deque[Slot] = deque()
        self._in_flight: Dict[int, PendingBatch] = {}  # ticket -> batch
        self._tickets = itertools.count()
        self._batch_seq = itertools.count()
        self._epoch: Optional[_Epoch] = None
        self._next_epoch = 0
        self._resume_iteration = 0
        self._closed = False
        self._layout_known = False  # until then, dispatch one batch at a time
        self._regions_cache: Tuple[Any, Any] = (None, None)

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        """Starts the workers now (with fork: call it before CUDA is initialised)."""
        self._check_open()
        self._pool.start()

    def close(self) -> None:
        """Stops the workers (of an owned pool) and frees the shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_pool:
            self._pool.close()
        else:
            self._abandon_epoch()
        self._epoch = None

    def __enter__(self) -> "ParallelSource":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):
        try:
            if self._owns_pool and not self._closed:
                self._pool.close()
        except Exception:
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError(f"source {self.name} is closed; no batches can be taken after close()")
        self._pool._check_usable()

    # -- what the pool asks of a source ----------------------------------------

    def _pickle_target(self) -> Any:
        return self.source

    def _worker_spec(self, worker: int, payload: Optional[bytes]) -> SourceSpec:
        slot_fds, overflow_fds = self._slots.worker_fds(worker)
        return SourceSpec(
            source_id=self._id,
            name=self.name,
            kind=self.kind,
            callback=self.source if payload is None else payload,
            pickled=payload is not None,
            batch_size=self.batch_size,
            num_outputs=self.num_outputs,
            batch_info=self.batch_info,
            dtypes=tuple(None if d is None else d.str for d in self.dtypes),
            ndims=self.ndims,
            shm_kind=backend(),
            slot_fds=slot_fds,
            overflow_fds=overflow_fds,
        )

    def _on_message(self, message: Union[TaskDone, TaskFailed]) -> None:
        pending = self._in_flight.pop(message.ticket, None)
        if pending is None:
            return
        pending.add(message)
        if pending.abandoned and pending.complete:
            self._slots.release(pending.slot)
        if not self._layout_known and isinstance(message, TaskDone) and message.count:
            self._learn_layout_from_task(message)

    def _learn_layout_from_task(self, message: TaskDone) -> None:
        # The first results tell the sample shapes, so that batches dispatched
        # from now on are written in place (dense) rather than to overflow.
        self._layout_known = True
        for j, placement in enumerate(message.placements):
            if placement is None or self._layouts[j] is not None:
                continue
            dtype_str, shape, _ = placement[0]
            if all(p[0] == dtype_str and p[1] == shape for p in placement):
                self._layouts[j] = (dtype_str, tuple(shape))

    def _release_memory(self) -> None:
        self._in_flight.clear()
        self._held.clear()
        self._slots.close()

    def _describe_task(self, task: Task) -> str:
        if self.kind == SAMPLE:
            base = task.iteration * self.batch_size
            return (
                f"samples {task.start}..{task.stop - 1} of batch {task.iteration} of epoch "
                f"{task.epoch_idx} (idx_in_epoch {base + task.start}..{base + task.stop - 1}) "
                f"of source {self.name}"
            )
        return f"batch {task.iteration} of epoch {task.epoch_idx} of source {self.name}"

    # -- epochs -----------------------------------------------------------------

    def __iter__(self) -> Iterator[BatchOutput]:
        """Starts the next epoch (abandoning an unfinished one) and returns its iterator."""
        self._check_open()
        self._abandon_epoch()
        self._pool.start()
        epoch = _Epoch(self, self._next_epoch, self._resume_iteration)
        self._next_epoch += 1
        self._resume_iteration = 0
        self._epoch = epoch
        self._fill()
        return epoch

    def get_state(self) -> Dict[str, int]:
        """Where the source stands: the next batch it would hand out (JSON-able)."""
        epoch = self._epoch
        if epoch is not None and not epoch.finished:
            return {"epoch_idx": epoch.epoch_idx, "iteration": epoch.next_yield}
        return {"epoch_idx": self._next_epoch, "iteration": self._resume_iteration}

    def set_state(self, state: Dict[str, int]) -> None:
        """Makes the next ``iter()`` resume at ``state`` (from :meth:`get_state`).

        Resuming mid-epoch needs a callable source (an iterator cannot be
        rewound); raises ``ValueError`` otherwise.
        """
        epoch_idx, iteration = int(state["epoch_idx"]), int(state["iteration"])
        if iteration and self.kind in (BATCH_ITERABLE, BATCH_GENERATOR):
            raise ValueError("resuming in the middle of an epoch needs a callable source, not an iterable")
        self._abandon_epoch()
        self._epoch = None
        self._next_epoch, self._resume_iteration = epoch_idx, iteration

    def _abandon_epoch(self) -> None:
        epoch = self._epoch
        if epoch is None:
            return
        epoch.finished = True
        for task in self._pool.discard_queued(self._id):
            pending = self._in_flight.pop(task.ticket, None)
            if pending is not None:
                pending.cancel(task.ticket)
        for pending in epoch.pending.values():
            pending.abandoned = True
            if pending.complete:
                self._slots.release(pending.slot)
        epoch.pending.clear()

    def _next_batch(self, epoch: _Epoch) -> BatchOutput:
        if epoch is not self._epoch or epoch.finished:
            raise StopIteration  # superseded by a newer epoch, or the source was closed
        self._check_open()
        if epoch.last_was_partial:
            self._end_epoch()
            raise StopIteration
        while len(self._held) >= self.batches_held:
            self._slots.release(self._held.popleft())
        pending = self._wait(epoch)
        del epoch.pending[epoch.next_yield]
        try:
            outcome = pending.build(self.last_batch, self.num_outputs, self.name)
        except BaseException:
            self._slots.release(pending.slot)
            self._end_epoch()
            raise
        if outcome is END_OF_EPOCH:
            self._slots.release(pending.slot)
            self._end_epoch()
            raise StopIteration
        self._held.append(pending.slot)
        epoch.next_yield += 1
        self._learn_layout(outcome)
        if None in pending.regions:
            outcome = self._compact(pending, outcome)
        if self._is_short(outcome):
            epoch.last_was_partial = True
        return outcome

    def _end_epoch(self) -> None:
        self._abandon_epoch()
        self._resume_iteration = 0

    def _is_short(self, outcome: BatchOutput) -> bool:
        first = outcome if self.num_outputs is None else outcome[0]
        return self.kind == SAMPLE and len(first) < self.batch_size

    # -- dispatch ---------------------------------------------------------------

    def _fill(self) -> None:
        """Dispatches batches of the current epoch into every free slot."""
        epoch = self._epoch
        if epoch is None or epoch.finished or epoch.last_was_partial:
            return
        while True:
            if not self._layout_known and epoch.pending:
                return
            slot = self._slots.acquire()
            if slot is None:
                return
            regions, size = self._regions()
            try:
                slot_size = slot.prepare(size)
            except SharedMemoryError as exc:
                self._slots.release(slot)
                raise with_advice(exc, slot.segment.kind, size * (len(self._slots.slots) + 1)) from None
            iteration = epoch.next_dispatch
            epoch.next_dispatch += 1
            pending = PendingBatch(next(self._batch_seq), epoch.epoch_idx, iteration, slot, regions)
            epoch.pending[iteration] = pending
            for start, stop in self._ranges():
                ticket = next(self._tickets)
                pending.expect(ticket, start, stop)
                self._in_flight[ticket] = pending
                task = Task(self._id, ticket, pending.seq, epoch.epoch_idx, iteration, start, stop,
                            slot.index, slot_size, regions)
                self._pool.submit(task, self._pinned_worker)

    def _ranges(self) -> List[Tuple[int, int]]:
        if self.kind != SAMPLE:
            return [(0, self.batch_size)]
        workers = self._pool.num_workers
        parts = min(self.batch_size, max(1, math.ceil(MAX_OUTSTANDING * workers / self.prefetch)))
        bounds = [round(i * self.batch_size / parts) for i in range(parts + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    def _regions(self) -> Tuple[Tuple[Optional[Region], ...], int]:
        """Where each output goes in a slot, and the bytes that takes (cached per layout)."""
        key = tuple(self._layouts)
        if self._regions_cache[0] != key:
            self._regions_cache = (key, self._compute_regions())
        return self._regions_cache[1]

    def _compute_regions(self) -> Tuple[Tuple[Optional[Region], ...], int]:
        regions: List[Optional[Region]] = []
        offset = 0
        for layout in self._layouts:
            if layout is None:
                regions.append(None)
                continue
            dtype_str, shape = layout
            regions.append((offset, dtype_str, shape))
            offset = align(offset + sample_nbytes(dtype_str, shape) * self.batch_size)
        return tuple(regions), offset

    def _learn_layout(self, outcome: BatchOutput) -> None:
        """Regions for later batches follow the shape and dtype of this batch's samples."""
        outputs = (outcome,) if self.num_outputs is None else outcome
        for j, samples in enumerate(outputs):
            if samples.is_dense:
                continue
            first = samples[0]
            uniform = all(s.shape == first.shape and s.dtype == first.dtype for s in samples)
            self._layouts[j] = (first.dtype.str, first.shape) if uniform else None

    def _compact(self, pending: PendingBatch, outcome: BatchOutput) -> BatchOutput:
        """Copies uniform outputs written before their shape was known into one dense region.

        Happens for the first batch of a source only; from then on workers write
        such outputs in place. The copy goes after the slot's regions in use.
        """
        outputs = [outcome] if self.num_outputs is None else list(outcome)
        end = 0
        for region in pending.regions:
            if region is not None:
                offset, dtype_str, shape = region
                end = max(end, offset + sample_nbytes(dtype_str, shape) * self.batch_size)
        for j, samples in enumerate(outputs):
            if samples.is_dense or self._layouts[j] is None or not samples:
                continue
            offset = align(end)
            end = offset + sum(sample.nbytes for sample in samples)
            pending.slot.prepare(end)
            dense = pending.slot.region_array(offset, samples[0].dtype, (len(samples),) + samples[0].shape)
            np.stack(samples, out=dense)
            outputs[j] = Batch(dense=dense)
        return outputs[0] if self.num_outputs is None else tuple(outputs)

    # -- waiting ----------------------------------------------------------------

    def _wait(self, epoch: _Epoch) -> PendingBatch:
        """Waits until the epoch's next batch is dispatched and all its tasks are back.

        Dispatch itself may have to wait: a slot may still be busy with a batch
        of an abandoned epoch until its tasks report back.
        """
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self._fill()
        while True:
            pending = epoch.pending.get(epoch.next_yield)
            if pending is not None and pending.complete:
                return pending
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise self._timed_out(epoch, pending)
            self._pool.receive(remaining)
            self._fill()

    def _timed_out(self, epoch: _Epoch, pending: Optional[PendingBatch]) -> SourceTimeoutError:
        stuck = []
        for worker, pid, task, running in self._pool.running_tasks(self._id):
            if pending is None or task.batch_seq == pending.seq:
                state = f"running for {running:.1f} s" if running else "queued behind another task"
                stuck.append(f"worker {worker} (pid {pid}): {self._describe_task(task)}, {state}")
        error = SourceTimeoutError(
            f"batch {epoch.next_yield} of epoch {epoch.epoch_idx} of source {self.name} was not "
            f"ready after timeout={self.timeout} s. Stuck: "
            + ("; ".join(stuck) if stuck else "no task was running")
            + ". The workers were shut down."
        )
        self._pool._break(error)
        return error
