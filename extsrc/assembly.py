"""Putting a batch back together from its tasks, in index order.

A :class:`PendingBatch` collects the results of the tasks a batch was split
into. Once all are in, :meth:`PendingBatch.build` decides what the consumer
gets: the batch, a shorter final batch, the end of the epoch, or the error of
the earliest failing sample, and builds zero-copy views of the slot's memory.
"""

from __future__ import annotations

import pickle
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from extsrc.batch import Batch
from extsrc.errors import CallbackError, SampleError, WorkerTraceback
from extsrc.messages import Region, TaskDone, TaskFailed, sample_nbytes
from extsrc.slots import Slot

END_OF_EPOCH = object()


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
        self.outstanding: set = set()  # tickets a worker may still write for
        self.abandoned = False  # nobody will read it: free the slot once nothing is outstanding

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

    def build(self, last_batch: str, num_outputs: Optional[int], source_name: str):
        """The consumer's outcome: a batch (``Batch`` or tuple), ``END_OF_EPOCH``, or raises.

        Raises the exception of the earliest failing sample, unless the epoch
        ended (``StopIteration``) before that sample.
        """
        ordered = sorted(
            ((self.ranges[t][0], msg) for t, msg in self.results.items()), key=lambda r: r[0]
        )
        stop_at: Optional[int] = None
        failure: Optional[TaskFailed] = None
        for start, msg in ordered:
            if isinstance(msg, TaskFailed):
                if failure is None or msg.position < failure.position:
                    failure = msg
            elif msg.stopped:
                end = start + msg.count
                stop_at = end if stop_at is None else min(stop_at, end)
        if failure is not None and (stop_at is None or failure.position < stop_at):
            raise rebuild_exception(failure, source_name)
        done = [(start, msg) for start, msg in ordered if isinstance(msg, TaskDone)]
        if stop_at is not None:
            if last_batch == "drop" or stop_at == 0:
                return END_OF_EPOCH
            size = stop_at
        else:
            size = sum(msg.count for _, msg in done)
        outputs = tuple(
            self._output(j, size, done) for j in range(1 if num_outputs is None else num_outputs)
        )
        return outputs[0] if num_outputs is None else outputs

    def _output(self, j: int, size: int, done: List[Tuple[int, TaskDone]]) -> Batch:
        region = self.regions[j]
        pieces = [(start, msg, min(msg.count, size - start)) for start, msg in done if start < size]
        if region is not None and all(msg.placements[j] is None for _, msg, _ in pieces):
            offset, dtype, shape = region
            return Batch(dense=self.slot.region_array(offset, np.dtype(dtype), (size,) + shape))
        samples: List[np.ndarray] = []
        for start, msg, take in pieces:
            placement = msg.placements[j]
            for k in range(take):
                if placement is None or placement[k][2] < 0:
                    samples.append(self._in_place(region, start + k))
                else:
                    dtype, shape, offset = placement[k]
                    view = self.slot.overflow_view(msg.worker, msg.overflow_size)
                    samples.append(view.array(offset, np.dtype(dtype), shape))
        _check_uniform(samples, j, self)
        return Batch(samples)

    def _in_place(self, region: Optional[Region], index: int) -> np.ndarray:
        assert region is not None, "in-place sample without a region"
        offset, dtype_str, shape = region
        return self.slot.region_array(
            offset + index * sample_nbytes(dtype_str, shape), np.dtype(dtype_str), shape
        )


def _check_uniform(samples: List[np.ndarray], output: int, batch: PendingBatch) -> None:
    if not samples:
        return
    first = samples[0]
    for k, sample in enumerate(samples):
        if sample.dtype != first.dtype or sample.ndim != first.ndim:
            raise SampleError(
                f"sample {k} of batch {batch.iteration} (epoch {batch.epoch_idx}), output "
                f"{output}: expected dtype {first.dtype} and {first.ndim} dimensions like "
                f"sample 0, got dtype {sample.dtype} with shape {sample.shape}; all samples "
                "of an output in a batch must share dtype and number of dimensions"
            )


def rebuild_exception(failure: TaskFailed, source_name: str) -> BaseException:
    """The worker's exception, re-created in the consumer with its worker traceback."""
    error: Optional[BaseException] = None
    if failure.error is not None:
        try:
            error = pickle.loads(failure.error)
        except Exception:
            error = None
    if error is None:
        error = CallbackError(f"{failure.type_name}: {failure.message}")
    if failure.in_callback:
        note = (
            f"raised by the callback of source {source_name} in extsrc worker "
            f"{failure.worker} at {failure.where}"
        )
        error.__cause__ = WorkerTraceback(f"{note}\nWorker traceback:\n{failure.traceback}")
        if hasattr(error, "add_note"):
            error.add_note(f"(extsrc: {note})")
    return error
