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
they are written. The first sample a writer sees tells the size of a batch:
before it is written, the memory the whole source will need is compared
with the limits (:func:`extsrc.shm.limits.check_source_need`), so that an
impossible request fails at once rather than after reserving what the limits
allow.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, TypeVar, Union

import numpy as np

from extsrc.arrays import Array, DType
from extsrc.engine import policy
from extsrc.engine.faults import SKIPPED
from extsrc.errors import SampleError, SharedMemoryError
from extsrc.shm import limits, streaming
from extsrc.shm.layout import Region, Spilled, align
from extsrc.shm.mapping import Mapping, view
from extsrc.shm.segment import Segment

if TYPE_CHECKING:
    from extsrc.engine.protocol import Task

Describe = Callable[[int], str]  # sample position -> "sample SampleInfo(...)"
_Done = TypeVar("_Done")


class Checker(Protocol):
    def check(self, value: object, output: int, position: int, describe: Describe,
              first: Optional[Array], first_at: int) -> Array: ...


_spilled = tuple.__new__  # a Spilled per ragged sample, without its __new__'s Python frame


class OverflowArea:
    """This worker's own segment of one slot: the samples that missed their region.

    Its reserved memory follows what the batches use: it grows (by
    :data:`~extsrc.engine.policy.OVERFLOW_GROWTH`) when a sample needs more, and once a task is
    written, more than :data:`~extsrc.engine.policy.OVERFLOW_KEEP` times what the batch uses so
    far is given back (:meth:`give_back`), so that a slot's memory is sized by its recent
    batches rather than by the largest spill ever (ragged samples whose sizes change from epoch
    to epoch). A steady workload settles below that line and gives nothing back."""

    def __init__(self, segment: Segment):
        self.segment = segment
        self.mapping: Optional[Mapping] = None
        # All of the mapping, made once: each sample is copied into a slice of it (a sample's
        # own array made over the mapping cost ~1.4 us, a slice of the memoryview ~0.6).
        self.base: Optional[Array] = None
        self.bytes = memoryview(b"")
        self.cursor = 0
        self.reserved = 0  # bytes from the segment's start reserved for samples
        self.batch_seq = -1
        self.recount = True  # a segment another worker may have written to (a replacement)

    def start_batch(self, batch_seq: int) -> None:
        # Tasks of one batch share the area; a new batch in this slot starts over (the
        # parent reuses a slot only once the consumer let go of its previous batch).
        if batch_seq != self.batch_seq:
            # This process's first batch here: a lost worker of this index may have written
            # samples of a batch still being filled (the same batch, its other tasks) at the
            # segment's start; they stay, and this batch's go after them.
            fresh = self.batch_seq < 0
            self.cursor = align(self.segment.allocated) if fresh else 0
            self.batch_seq = batch_seq
            self.recount = fresh or self.reserved > 0

    def _recount(self) -> None:
        # The consumer may have given back part of this area since the last batch (see
        # SlotPool.fit_overflow): what is reserved is counted again before anything is written,
        # so that running short stays a SharedMemoryError.
        self.recount = False
        self.reserved = self.segment.recount()

    def alloc(self, dtype: DType, shape: Tuple[int, ...]) -> Tuple[int, Array]:
        """Room for one sample: ``(byte offset in the segment, a writable array there)``."""
        offset = self._room(dtype.itemsize * math.prod(shape))
        assert self.base is not None
        return offset, view(self.base, offset, dtype, shape)

    def put(self, array: Array) -> int:
        """Copies ``array`` in; returns its byte offset in the segment."""
        nbytes = array.nbytes
        offset = self._room(nbytes)
        if nbytes:
            if type(array) is not np.ndarray:  # a subclass's .data may be an array (np.ma)
                array = array.view(np.ndarray)
            try:  # its bytes as they are (Spilled keeps the dtype): no array made over the room
                self.bytes[offset:offset + nbytes] = array.data.cast("B")
            except (TypeError, ValueError):  # not C-contiguous
                assert self.base is not None
                view(self.base, offset, array.dtype, array.shape)[...] = array
        return offset

    def _room(self, nbytes: int) -> int:
        """Reserves ``nbytes`` at the cursor, aligned; returns their offset."""
        offset = align(self.cursor)
        end = offset + nbytes
        if self.recount:
            self._recount()
        if self.mapping is None or end > self.reserved:  # mapped even for empty samples: they need a view
            self.reserved = self.segment.reserve(max(end, int(policy.OVERFLOW_GROWTH * self.reserved),
                                                     policy.MIN_OVERFLOW))
            if self.mapping is None or self.mapping.size < self.reserved:
                self.mapping = self.segment.map(self.reserved)
                self.base = self.mapping.array(0, np.dtype(np.uint8), (self.mapping.size,))
                self.bytes = self.base.data
        self.cursor = end
        return offset

    @property
    def used(self) -> int:
        return self.cursor

    def give_back(self) -> None:
        """Gives the reserved memory back past ``OVERFLOW_KEEP`` times what this batch uses so far
        (and past :data:`~extsrc.engine.policy.MIN_OVERFLOW`): nothing of the batch lies there, and the
        slot's previous batch is no longer read (a slot is reused only once it is dropped)."""
        keep = max(int(policy.OVERFLOW_KEEP * self.cursor), policy.MIN_OVERFLOW)
        if self.reserved > keep:
            self.reserved = self.segment.give_back(keep)


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
        self.overflow.base, self.overflow.bytes = None, memoryview(b"")  # none outlives the unmapping
        for mapping in (self.region_map, self.overflow.mapping):
            if mapping is not None:
                mapping.close()
        self.region.close()
        self.overflow.segment.close()


class TaskWriter:
    """Writes the samples a worker produced for the tasks of one source.

    ``slots_kept``: batches of memory the source keeps (``prefetch +
    batches_held``); with it, the first sample is followed by a check of the
    source's whole need against the limits (0: no such check).
    """

    def __init__(self, label: str, checker: Checker, batch_size: int, slots_kept: int = 0):
        self.label = label
        self.checker = checker
        self.batch_size = batch_size
        self.slots_kept = slots_kept
        self.need_checked = slots_kept <= 0
        self.slots: Dict[int, WorkerSlot] = {}

    def check_need(self, sample_bytes: int) -> None:
        """Once, at the first sample (``sample_bytes``, all outputs): raises
        :class:`~extsrc.errors.SharedMemoryError` if the source's batches cannot fit the limits."""
        if self.need_checked or sample_bytes <= 0:
            return
        self.need_checked = True
        batch = sample_bytes * self.batch_size
        kind = next(iter(self.slots.values())).region.kind if self.slots else "memfd"
        limits.check_source_need(
            limits.source_need(batch, self.slots_kept), self.label, kind,
            f"batches of {self.batch_size} samples of {limits.format_bytes(sample_bytes)}, "
            f"{limits.format_bytes(batch)} each: one in each of the {self.slots_kept} slots it keeps "
            "(prefetch + batches_held) and the first batch",
        )

    def add_slot(self, slot_id: int, region_fd: int, overflow_fd: int, kind: str, worker: int) -> None:
        self.slots[slot_id] = WorkerSlot(
            Segment(region_fd, kind, f"{self.label}, slot {slot_id}"),
            Segment(overflow_fd, kind, f"{self.label}, slot {slot_id}, worker {worker}"),
        )

    def holds(self, slot_id: int) -> bool:
        """Whether the slot's descriptors were added (and not dropped since)."""
        return slot_id in self.slots

    def drop_slot(self, slot_id: int) -> None:
        slot = self.slots.pop(slot_id, None)
        if slot is not None:
            slot.close()

    def close(self) -> None:
        for slot_id in list(self.slots):
            self.drop_slot(slot_id)

    def answer(self, task: Task, write: object, done: _Done) -> _Done:
        """The answer to a task written here: the engine's own (see :mod:`extsrc.engine.sink`,
        the seam this writer serves)."""
        return done

    def begin(self, slot_id: int, batch_seq: int, start: int, stop: int, region_bytes: int,
              regions: Tuple[Optional[Region], ...], describe: Describe) -> "TaskWrite":
        """Starts writing the samples ``start..stop-1`` of a batch into slot ``slot_id``."""
        slot = self.slots[slot_id]
        slot.overflow.start_batch(batch_seq)
        return TaskWrite(self, slot, start, stop, region_bytes, regions, describe)

    def write(
        self, slot_id: int, batch_seq: int, start: int, stop: int, region_bytes: int,
        regions: Tuple[Optional[Region], ...], columns: List[Sequence[object]], count: int,
        describe: Describe,
    ) -> Tuple[Tuple[Tuple[Spilled, ...], ...], int]:
        """Writes ``columns[j][k]`` (output ``j``, sample ``start + k``) into the slot, at once.

        Returns, per output, the samples spilled to overflow, and the bytes of
        overflow in use. Raises :class:`~extsrc.errors.SampleError` for an
        invalid sample and :class:`~extsrc.errors.SharedMemoryError` when
        memory runs out.
        """
        task = self.begin(slot_id, batch_seq, start, stop, region_bytes, regions, describe)
        task.add(columns, start, count)
        return task.finish()  # (give_back: see Task; the caller's write is one of many)


class TaskWrite:
    """The samples of one task going into its slot, a chunk at a time.

    A worker adds samples as the callback makes them (:meth:`add`), so that
    large ones are written and dropped one by one and the callback's memory
    is reused rather than faulted in anew; :meth:`alloc` hands the callback
    the sample's place in shared memory, so that it can write the sample
    there itself (then nothing is copied). :meth:`finish` says what spilled.
    """

    def __init__(self, writer: TaskWriter, slot: WorkerSlot, start: int, stop: int,
                 region_bytes: int, regions: Tuple[Optional[Region], ...], describe: Describe):
        self.writer = writer
        self.slot = slot
        self.start, self.stop = start, stop
        self.regions = regions
        self.describe = describe
        self.region_map = slot.region_view(region_bytes) if region_bytes else None
        self.spilled: List[List[Spilled]] = [[] for _ in regions]
        self.first: List[Optional[Array]] = [None] * len(regions)
        self.first_at = [0] * len(regions)  # its position, described only when an error needs it
        self._rows: List[Optional[Array]] = [None] * len(regions)
        self._given: Dict[Tuple[int, int], Tuple[int, Optional[Spilled]]] = {}  # see alloc

    def _region_rows(self, j: int) -> Optional[Array]:
        """Output ``j``'s region for samples ``start..stop-1`` (rows), or None without one."""
        rows = self._rows[j]
        region = self.regions[j]
        if rows is None and region is not None and self.region_map is not None:
            rows = self.region_map.array(region.offset + self.start * region.stride,
                                         np.dtype(region.dtype), (self.stop - self.start,) + region.shape)
            self._rows[j] = rows
        return rows

    def alloc(self, output: int, position: int, shape: Tuple[int, ...], dtype: DType) -> Array:
        """A writable array in shared memory for sample ``position`` of ``output``.

        Its place in the output's region when ``shape`` and ``dtype`` are the
        region's (the batch stays one dense array), else in this worker's
        overflow. A sample returned as this very array is not copied.
        """
        checker = self.writer.checker
        probe = np.empty((0,) * len(shape), dtype)  # checks dtype and ndim as a sample would be
        checker.check(probe, output, position, self.describe, None, 0)
        if not self.writer.need_checked:
            self.writer.check_need(dtype.itemsize * math.prod(shape))
        rows = self._region_rows(output)
        region = self.regions[output]
        if rows is not None and region is not None and dtype.str == region.dtype and shape == region.shape:
            row: Array = rows[position - self.start]  # (NumPy's stub: untyped)
            self._given[(output, position)] = (row.__array_interface__["data"][0], None)
            return row
        try:
            offset, array = self.slot.overflow.alloc(dtype, shape)
        except SharedMemoryError as exc:
            raise self._with_advice(exc, dtype.itemsize * math.prod(shape)) from None
        placed = Spilled(position, dtype.str, shape, offset)
        self._given[(output, position)] = (array.__array_interface__["data"][0], placed)
        return array

    def direct_rows(self, sample: object, position: int) -> Optional[Array]:
        """Rows the runner may write small samples into itself, one by one as they come.

        Given when the task has one output whose region is known, the source's
        need was checked, nothing was handed out by :meth:`alloc`, and
        ``sample`` (for ``position``, not written yet) is a plain ndarray of
        the region's dtype and shape under ``STREAM_MIN_BYTES``: row ``k``
        is sample ``start + k``. The runner then writes there exactly the
        samples :meth:`add` would have written in one copy (same checks: class,
        shape, dtype) and hands any other to :meth:`add`. ``sample`` is
        noted as the task's first (what later samples' errors compare with).
        ``None`` otherwise: everything goes through :meth:`add`.
        """
        if len(self.regions) != 1 or self._given or not self.writer.need_checked:
            return None
        rows = self._region_rows(0)
        if (rows is None or type(sample) is not np.ndarray or sample.shape != rows.shape[1:]
                or sample.dtype != rows.dtype or sample.nbytes >= policy.STREAM_MIN_BYTES):
            return None
        self._note_first(0, rows[position - self.start, ...], position)
        return rows

    def widen(self, outputs: int) -> None:
        """Makes room for ``outputs`` outputs; those beyond the task's regions spill (a source
        whose number of outputs the consumer had not learnt when it sent the task)."""
        extra = outputs - len(self.regions)
        if extra > 0:
            self.regions = tuple(self.regions) + (None,) * extra
            self.spilled += [[] for _ in range(extra)]
            self.first += [None] * extra
            self.first_at += [0] * extra
            self._rows += [None] * extra

    def add(self, columns: List[Sequence[object]], position: int, count: int) -> None:
        """Writes ``columns[j][k]`` (output ``j``, sample ``position + k``; ``SKIPPED``: none).
        No columns: every sample was skipped before the outputs were known."""
        if not count or not columns:
            return
        if len(columns) != len(self.regions):
            if len(columns) < len(self.regions):  # only with num_outputs="auto"
                error = SampleError(
                    f"{self.describe(position)}: {len(columns)} outputs, and the source's samples "
                    f"so far had {len(self.regions)}; every sample must have as many outputs"
                )
                error.position = position
                raise error
            self.widen(len(columns))
        if not self.writer.need_checked:
            self.writer.check_need(sum(_sample_bytes(column[0]) for column in columns))
        try:
            for j, column in enumerate(columns):
                self._add_output(j, column, position, count)
        except SharedMemoryError as exc:
            sample_bytes = sum(np.asarray(column[0]).nbytes for column in columns)
            raise self._with_advice(exc, sample_bytes) from None

    def _with_advice(self, exc: SharedMemoryError, sample_bytes: int) -> SharedMemoryError:
        # Every slot holds a batch, and the first batch also fills the overflow.
        total = (len(self.writer.slots) + 1) * sample_bytes * self.writer.batch_size
        return limits.with_advice(exc, self.slot.region.kind, total)

    def _add_output(self, j: int, column: Sequence[object], position: int, count: int) -> None:
        rows = self._region_rows(j)
        k0 = position - self.start
        if rows is not None:
            destination = rows[k0:k0 + count]
            if self._given and _is_in_place(column, destination):
                self._note_first(j, destination[0, ...], position)
                return
            if _write_dense(column, destination):
                self._note_first(j, destination[0, ...], position)
                return
        checker = self.writer.checker
        spilled_dtype: Optional[DType] = None  # the last spilled sample's dtype, and its name,
        spilled_str = ""                        # made once rather than per sample
        for k in range(count):
            if column[k] is SKIPPED:
                continue  # on_error="skip": nothing written; the consumer leaves it out
            sample_position = position + k
            array = checker.check(column[k], j, sample_position, self.describe, self.first[j],
                                  self.first_at[j])
            self._note_first(j, array, sample_position)
            given = self._given.get((j, sample_position))
            if given is not None and array.__array_interface__["data"][0] == given[0]:
                if given[1] is not None and array.shape == given[1].shape:
                    self.spilled[j].append(given[1])  # written by the callback in overflow
                    continue
                if given[1] is None and rows is not None and array.shape == rows.shape[1:]:
                    continue  # written by the callback in place
            if rows is not None and array.dtype == rows.dtype and array.shape == rows.shape[1:]:
                if array.nbytes >= policy.STREAM_MIN_BYTES:
                    streaming.copy(rows[sample_position - self.start], array)
                else:
                    rows[sample_position - self.start] = array
            else:
                offset = self.slot.overflow.put(array)
                if array.dtype is not spilled_dtype:
                    spilled_dtype, spilled_str = array.dtype, array.dtype.str
                self.spilled[j].append(_spilled(Spilled, (sample_position, spilled_str, array.shape,
                                                          offset)))

    def _note_first(self, j: int, sample: Array, position: int) -> None:
        """Notes output ``j``'s first sample of the task, what later ones are checked against:
        a row taken as ``rows[k, ...]``, a 0-d view for samples of shape () where ``rows[k]``
        would be a NumPy scalar, whose byte order is always native."""
        if self.first[j] is None:
            self.first[j], self.first_at[j] = sample, position

    def finish(self, give_back: bool = False) -> Tuple[Tuple[Tuple[Spilled, ...], ...], int]:
        """Per output, the samples spilled to overflow; and the bytes of overflow in use. With
        ``give_back`` (the task's), gives back the overflow memory this batch does not need
        (:meth:`OverflowArea.give_back`)."""
        overflow = self.slot.overflow
        if give_back:
            overflow.give_back()
        return tuple(tuple(s) for s in self.spilled), overflow.used


def _sample_bytes(value: object) -> int:
    """The bytes of one sample as the callback returned it (0 when it is no array: the
    checker then says what is wrong with it)."""
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    try:
        return int(np.asarray(value).nbytes)
    except Exception:
        return 0


def _is_in_place(column: Sequence[object], destination: Array) -> bool:
    """Whether every sample is already the row of ``destination`` it belongs in."""
    if len(column) != len(destination):
        return False
    base = destination.__array_interface__["data"][0]
    stride = destination.strides[0] if destination.ndim else 0
    for k, sample in enumerate(column):
        if (sample.__class__ is not np.ndarray or sample.dtype != destination.dtype
                or sample.shape != destination.shape[1:]
                or sample.__array_interface__["data"][0] != base + k * stride):
            return False
    return True


def _write_dense(column: Union[Array, Sequence[Any]], destination: Array) -> bool:
    """Fast path: every sample has the region's dtype and shape; one C-level copy.

    False (nothing written) when a sample differs: the caller checks samples one by one.
    """
    if isinstance(column, np.ndarray):
        if column.dtype != destination.dtype or column.shape != destination.shape:
            return False
        streaming.copy(destination, column)
        return True
    shape, dtype = destination.shape[1:], destination.dtype
    first = column[0] if len(column) else None
    if (len(column) > 1 and first.__class__ is np.ndarray and first.shape == shape
            and first.dtype == dtype and all(sample is first for sample in column)):
        destination[...] = first  # one array for every sample (a constant output): broadcast
        return True
    ndarray = np.ndarray
    for sample in column:
        # Identity first: the dtype of a plain NumPy type is one object, and `!=` costs ~40 ns.
        if (sample.__class__ is not ndarray or sample.shape != shape
                or (sample.dtype is not dtype and sample.dtype != dtype)):
            return False
    if not shape:  # 0-d samples cannot be concatenated
        destination[...] = column
        return True
    if first is not None and destination.itemsize * first.size >= policy.STREAM_MIN_BYTES:
        for k, sample in enumerate(column):  # large samples: each past the caches
            streaming.copy(destination[k], sample)
        return True
    # Samples of equal shape, one after the other along axis 0: the batch's memory layout.
    np.concatenate(column, axis=0, out=destination.reshape((-1,) + shape[1:]))
    return True
