"""Worker side of shared memory: where a sample is written.

A worker knows each slot of its sources by the descriptors it received
(:class:`WorkerSlot`): the region segment, shared by all workers, and its
own overflow segment. For each task it gets the regions of the outputs: a
sample that has its region's dtype and shape is written in place at
``region.offset + idx_in_batch * region.stride``, so an output whose samples
all fit forms one dense array. Any other sample (first batch, ragged shapes,
another dtype) is *spilled*: appended to the worker's overflow segment of the
slot, which grows (x2) as needed and starts over at each new batch.

Samples are checked (:class:`~extsrc.engine.samples.SampleChecker`) before
they are written.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from extsrc.errors import SharedMemoryError
from extsrc.shm import limits
from extsrc.shm.layout import Region, Spilled, align
from extsrc.shm.mapping import Mapping
from extsrc.shm.segment import Segment

MIN_OVERFLOW = 1 << 20  # first size of an overflow segment: one growth covers most first batches

Describe = Callable[[int], str]  # sample position -> "sample SampleInfo(...)"


class Checker(Protocol):
    def check(self, value: object, output: int, position: int, where: str,
              first: Optional[np.ndarray], first_where: str) -> np.ndarray: ...


class OverflowArea:
    """This worker's own segment of one slot: the samples that missed their region."""

    def __init__(self, segment: Segment):
        self.segment = segment
        self.mapping: Optional[Mapping] = None
        self.cursor = 0
        self.batch_seq = -1

    def start_batch(self, batch_seq: int) -> None:
        # Tasks of one batch share the area; a new batch in this slot starts over (the
        # parent reuses a slot only once the consumer let go of its previous batch).
        if batch_seq != self.batch_seq:
            self.batch_seq = batch_seq
            self.cursor = 0

    def put(self, array: np.ndarray) -> int:
        """Copies ``array`` in; returns its byte offset in the segment."""
        offset = align(self.cursor)
        end = offset + array.nbytes
        size = 0 if self.mapping is None else self.mapping.size
        if end > size:
            reserved = self.segment.reserve(max(end, 2 * size, MIN_OVERFLOW))
            self.mapping = self.segment.map(reserved)
        if array.nbytes:
            self.mapping.array(offset, array.dtype, array.shape)[...] = array
        self.cursor = end
        return offset

    @property
    def used(self) -> int:
        return self.cursor


class WorkerSlot:
    """A slot as one worker sees it."""

    def __init__(self, region: Segment, overflow: Segment):
        self.region = region
        self.region_map: Optional[Mapping] = None
        self.overflow = OverflowArea(overflow)

    def region_view(self, region_bytes: int) -> Mapping:
        if self.region_map is None or self.region_map.size < region_bytes:
            self.region_map = self.region.map(self.region.size)
        return self.region_map

    def close(self) -> None:
        for mapping in (self.region_map, self.overflow.mapping):
            if mapping is not None:
                mapping.close()
        self.region.close()
        self.overflow.segment.close()


class TaskWriter:
    """Writes the samples a worker produced for the tasks of one source."""

    def __init__(self, label: str, checker: Checker, batch_size: int):
        self.label = label
        self.checker = checker
        self.batch_size = batch_size
        self.slots: Dict[int, WorkerSlot] = {}

    def add_slot(self, slot_id: int, region_fd: int, overflow_fd: int, kind: str, worker: int) -> None:
        self.slots[slot_id] = WorkerSlot(
            Segment(region_fd, kind, f"{self.label}, slot {slot_id}"),
            Segment(overflow_fd, kind, f"{self.label}, slot {slot_id}, worker {worker}"),
        )

    def drop_slot(self, slot_id: int) -> None:
        slot = self.slots.pop(slot_id, None)
        if slot is not None:
            slot.close()

    def close(self) -> None:
        for slot_id in list(self.slots):
            self.drop_slot(slot_id)

    def write(
        self, slot_id: int, batch_seq: int, start: int, stop: int, region_bytes: int,
        regions: Tuple[Optional[Region], ...], columns: List[Sequence[object]], count: int,
        describe: Describe,
    ) -> Tuple[Tuple[Tuple[Spilled, ...], ...], int]:
        """Writes ``columns[j][k]`` (output ``j``, sample ``start + k``) into the slot.

        Returns, per output, the samples spilled to overflow, and the bytes of
        overflow in use. Raises :class:`~extsrc.errors.SampleError` for an
        invalid sample and :class:`~extsrc.errors.SharedMemoryError` when
        memory runs out.
        """
        slot = self.slots[slot_id]
        slot.overflow.start_batch(batch_seq)
        region_map = slot.region_view(region_bytes) if region_bytes else None
        try:
            spilled = tuple(
                self._write_output(j, regions[j], start, stop, column, count, region_map,
                                   slot.overflow, describe)
                for j, column in enumerate(columns)
            )
        except SharedMemoryError as exc:
            # Every slot holds a batch, and the first batch also fills the overflow.
            sample_bytes = sum(np.asarray(column[0]).nbytes for column in columns if count)
            raise limits.with_advice(exc, slot.region.kind,
                                     (len(self.slots) + 1) * sample_bytes * self.batch_size) from None
        return spilled, slot.overflow.used

    def _write_output(self, j, region, start, stop, column, count, region_map, overflow,
                      describe) -> Tuple[Spilled, ...]:
        in_place = None
        fits = max(0, min(count, stop - start))  # samples that have a place in the region
        if region is not None and fits and region_map is not None:
            in_place = region_map.array(region.offset + start * region.stride, np.dtype(region.dtype),
                                        (stop - start,) + region.shape)
            if fits == count and _write_dense(column, in_place[:count]):
                return ()
        return self._write_each(j, start, column, count, in_place, fits, overflow, describe)

    def _write_each(self, j, start, column, count, in_place, fits, overflow, describe):
        first: Optional[np.ndarray] = None
        first_where = ""
        spilled = []
        for k in range(count):
            where = describe(start + k)
            array = self.checker.check(column[k], j, start + k, where, first, first_where)
            if first is None:
                first, first_where = array, where
            if (
                in_place is not None
                and k < fits
                and array.dtype == in_place.dtype
                and array.shape == in_place.shape[1:]
            ):
                in_place[k] = array
            else:
                spilled.append(Spilled(start + k, array.dtype.str, array.shape, overflow.put(array)))
        return tuple(spilled)


def _write_dense(column, destination: np.ndarray) -> bool:
    """Fast path: every sample has the region's dtype and shape; one C-level copy.

    False (nothing written) when a sample differs: the caller checks samples one by one.
    """
    if isinstance(column, np.ndarray):
        if column.dtype != destination.dtype or column.shape != destination.shape:
            return False
        destination[...] = column
        return True
    shape, dtype = destination.shape[1:], destination.dtype
    for sample in column:
        if sample.__class__ is not np.ndarray or sample.shape != shape or sample.dtype != dtype:
            return False
    if not shape:  # 0-d samples cannot be concatenated
        destination[...] = column
        return True
    # Samples of equal shape, one after the other along axis 0: the batch's memory layout.
    np.concatenate(column, axis=0, out=destination.reshape((-1,) + shape[1:]))
    return True
