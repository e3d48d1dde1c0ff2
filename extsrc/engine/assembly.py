"""Putting a batch back together from its tasks, in index order.

A :class:`PendingBatch` collects the results of the tasks a batch was split
into. Once all are in, :meth:`PendingBatch.decide` says what the consumer
gets (a batch of some size, the end of the epoch, or the error of the
earliest failing sample), and :meth:`PendingBatch.build` makes the batch's
zero-copy arrays from a :class:`~extsrc.shm.slots.Lease`: every array of the
batch keeps the lease, and with it the memory, alive.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Set, Tuple, Union

import numpy as np

from extsrc.arrays import Array, DType
from extsrc.batch import Batch
from extsrc.errors import CallbackError, ExtsrcError, SampleError, WorkerTraceback
from extsrc.engine.faults import SampleFault
from extsrc.engine.pickling import loads_exception
from extsrc.engine.protocol import TaskDone, TaskFailed
from extsrc.engine.samples import describe_dtype
from extsrc.shm.layout import Region
from extsrc.shm.mapping import Mapping, view
from extsrc.shm.slots import Lease, Slot

Output = Union[Batch, Array]  # an ndarray: a dense output of a source with dense_arrays=True
BatchOutput = Union[Output, Tuple[Output, ...]]


class Decision(NamedTuple):
    """What a complete batch turns into: ``size`` samples, or the end of the epoch
    (``size == 0``), or ``error`` to raise in its place. ``ended``: the epoch ends with this
    batch."""

    size: int
    ended: bool
    error: Optional[BaseException] = None
    produced: int = 0  # samples produced before the end (for an empty epoch's message)


class PendingBatch:
    """One batch in production: its slot, its regions and its tasks' results."""

    def __init__(self, seq: int, epoch_idx: int, iteration: int, slot: Slot,
                 regions: Tuple[Optional[Region], ...]):
        self.seq = seq
        self.epoch_idx = epoch_idx
        self.iteration = iteration
        self.slot = slot
        self.regions = regions
        self.ranges: Dict[int, Tuple[int, int]] = {}  # ticket -> (start, stop)
        self.results: Dict[int, Union[TaskDone, TaskFailed]] = {}
        self.outstanding: Set[int] = set()  # tickets a worker may still write for
        self._order: Optional[List[Tuple[int, Union[TaskDone, TaskFailed]]]] = None

    def expect(self, ticket: int, start: int, stop: int) -> None:
        self.ranges[ticket] = (start, stop)
        self.outstanding.add(ticket)

    def add(self, message: Union[TaskDone, TaskFailed]) -> None:
        self.results[message.ticket] = message
        self.outstanding.discard(message.ticket)

    def cancel(self, ticket: int) -> None:
        """The task was never sent to a worker; nothing will come for it."""
        self.outstanding.discard(ticket)

    @property
    def complete(self) -> bool:
        return not self.outstanding

    @property
    def spilled(self) -> bool:
        """Whether any sample went to a worker's overflow segment."""
        return any(isinstance(m, TaskDone) and any(m.spilled) for m in self.results.values())

    def _ordered(self) -> List[Tuple[int, Union[TaskDone, TaskFailed]]]:
        """``(start, result)`` by start; computed once the batch is complete."""
        if self._order is None or len(self._order) != len(self.results):
            self._order = sorted(((self.ranges[t][0], m) for t, m in self.results.items()),
                                 key=lambda r: r[0])
        return self._order

    def decide(self, last_batch: str, source_name: str) -> Decision:
        """What the consumer gets (see :class:`Decision`); only once :attr:`complete`.

        The exception of the earliest failing sample wins, unless the epoch
        ended (``StopIteration``) before that sample.
        """
        stop_at: Optional[int] = None
        failure: Optional[TaskFailed] = None
        produced = 0
        for start, msg in self._ordered():
            if isinstance(msg, TaskFailed):
                if failure is None or msg.position < failure.position:
                    failure = msg
            else:
                produced += msg.samples
                if msg.stopped:
                    end = start + msg.samples
                    stop_at = end if stop_at is None else min(stop_at, end)
        if failure is not None and (stop_at is None or failure.position < stop_at):
            # The batch fails; the epoch ends with it only if it also ended in this batch.
            return Decision(0, stop_at is not None, rebuild_exception(failure, source_name))
        if stop_at is None:
            return Decision(produced, False, produced=produced)
        if last_batch == "drop" or stop_at == 0:
            return Decision(0, True, produced=stop_at)
        return Decision(stop_at, True, produced=stop_at)

    @property
    def faults(self) -> Tuple[SampleFault, ...]:
        """The samples skipped or replaced (``on_error``), by position."""
        found = [f for m in self.results.values() if isinstance(m, TaskDone) for f in m.faults]
        return tuple(sorted(found, key=lambda f: f.idx_in_batch))

    def _skipped(self, size: int) -> Set[int]:
        return {f.idx_in_batch for m in self.results.values() if isinstance(m, TaskDone)
                for f in m.faults if not f.replaced and f.idx_in_batch < size}

    def overflow_use(self) -> Dict[int, Optional[int]]:
        """Per worker that answered, the bytes of its overflow segment the batch's samples take
        (``None`` when one of its tasks failed: what it wrote before is not known)."""
        use: Dict[int, Optional[int]] = {}
        for msg in self.results.values():
            if isinstance(msg, TaskFailed):
                use[msg.worker] = None
            elif use.get(msg.worker, 0) is not None:
                use[msg.worker] = max(use.get(msg.worker) or 0, msg.overflow_bytes if any(msg.spilled) else 0)
        return use

    def overflow_sizes(self, size: int) -> Dict[int, int]:
        """Bytes to map of each worker's overflow segment to read the first ``size`` samples."""
        sizes: Dict[int, int] = {}
        for start, msg in self._ordered():
            if isinstance(msg, TaskDone) and start < size and any(msg.spilled):
                # At least a byte: spilled samples that are all empty still need a mapping to view.
                sizes[msg.worker] = max(sizes.get(msg.worker, 0), msg.overflow_bytes, 1)
        return sizes

    def build(self, lease: Lease, size: int, num_outputs: Optional[int],
              dense_arrays: bool = False) -> BatchOutput:
        """The first ``size`` samples as zero-copy arrays that keep ``lease`` alive; with
        ``dense_arrays``, an output written side by side is that one array, not a Batch."""
        region_map = lease.region
        bases: Dict[int, Array] = {}  # mapping id -> base array; local, so no cycle with the lease

        def base_of(mapping: Optional[Mapping]) -> Array:
            array = bases.get(id(mapping))
            if array is None:
                assert mapping is not None, "samples in place, and the lease has no region mapping"
                array = bases[id(mapping)] = lease.base(mapping)
            return array

        done = [(start, msg) for start, msg in self._ordered()
                if isinstance(msg, TaskDone) and start < size]
        skipped = self._skipped(size) if any(msg.faults for _, msg in done) else set()
        outputs: List[Output] = []
        for j in range(1 if num_outputs is None else num_outputs):
            # None too for an output the batch was dispatched without (num_outputs="auto").
            region = self.regions[j] if j < len(self.regions) else None
            if region is not None and not skipped and not any(msg.spilled and msg.spilled[j]
                                                              for _, msg in done):
                dense = view(base_of(region_map), region.offset, np.dtype(region.dtype),
                             (size,) + region.shape)
                outputs.append(dense if dense_arrays else Batch(dense=dense))
                continue
            samples: List[Array] = []
            dtypes: Dict[str, DType] = {}  # a ragged output's dtype, made once per batch
            for start, msg in done:
                spilled = {s.position: s for s in msg.spilled[j]} if msg.spilled else {}
                overflow = base_of(lease.overflow[msg.worker]) if spilled else None
                for position in range(start, min(start + msg.samples, size)):
                    if position in skipped:
                        continue
                    placed = spilled.get(position)
                    if placed is None:
                        assert region is not None, "a sample in place without a region"
                        samples.append(view(base_of(region_map), region.offset + position * region.stride,
                                            np.dtype(region.dtype), region.shape))
                    else:
                        dtype = dtypes.get(placed.dtype)
                        if dtype is None:
                            dtype = dtypes[placed.dtype] = np.dtype(placed.dtype)
                        assert overflow is not None
                        samples.append(view(overflow, placed.offset, dtype, placed.shape))
            _check_uniform(samples, j, self)
            outputs.append(Batch(samples))
        return outputs[0] if num_outputs is None else tuple(outputs)


def _check_uniform(samples: List[Array], output: int, batch: PendingBatch) -> None:
    if not samples:
        return
    first = samples[0]
    for k, sample in enumerate(samples):
        if sample.dtype != first.dtype or sample.ndim != first.ndim:
            raise SampleError(
                f"sample {k} of batch {batch.iteration} (epoch {batch.epoch_idx}), output "
                f"{output}: expected dtype {describe_dtype(first.dtype, sample.dtype)} and "
                f"{first.ndim} dimensions like sample 0 of the batch, got dtype "
                f"{describe_dtype(sample.dtype, first.dtype)} with shape {sample.shape}; all "
                "samples of an output in a batch must share dtype and number of dimensions"
            )


def rebuild_exception(failure: TaskFailed, source_name: str) -> BaseException:
    """The worker's exception, re-created in the consumer with its worker traceback."""
    error = loads_exception(failure.error) if failure.error is not None else None
    if error is None:
        error = CallbackError(f"{failure.type_name}: {failure.message}")
    if failure.in_callback:
        where = f" at {failure.where}" if failure.where is not None else ""
        note = (
            f"raised by the callback of source {source_name} in extsrc worker "
            f"{failure.worker}{where}"
        )
    else:
        at_from = f" from {failure.where} on" if failure.where is not None else ""
        note = (
            f"raised in extsrc worker {failure.worker} while checking or writing what the "
            f"callback of source {source_name} returned{at_from}"
        )
    error.__cause__ = WorkerTraceback(f"{note}\nWorker traceback:\n{failure.traceback}")
    # extsrc's own errors say what and where in their message; any other one needs the note.
    if (failure.in_callback or not isinstance(error, ExtsrcError)) and hasattr(error, "add_note"):
        error.add_note(f"(extsrc: {note})")
    return error
