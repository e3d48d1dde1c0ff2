"""Worker side of shared memory: where a sample is written.

For each task the worker gets a slot (one batch's worth of shared memory) and,
per output, a region: the place where sample ``k`` of the batch goes when it
has the region's dtype and shape. Samples that fit are written in place, so an
output whose samples all fit forms one dense array. A sample that does not fit
(first batch, ragged shapes, a different dtype) is appended to this worker's
own overflow segment for the slot, which grows (x2) as needed.

Every sample is validated here, in the worker, before it is written: the
consumer only ever sees arrays of a numeric or bool dtype that match the
declared dtype/ndim.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from extsrc.errors import SampleError, SharedMemoryError
from extsrc.messages import Placement, Region, Task, sample_nbytes
from extsrc.shm import Mapping, Segment, align, with_advice

_VALID_KINDS = frozenset("biufc")  # bool, ints, unsigned, floats, complex
_MIN_OVERFLOW = 1 << 20

Describe = Callable[[int], str]  # sample position -> "sample 5 (SampleInfo(...))"


def _describe_value(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, np.ndarray):
        return f"an array of dtype {value.dtype} and shape {value.shape}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items {text}"
    return f"{type(value).__name__} {text}"


def to_sample_array(
    value: object,
    output: int,
    where: str,
    dtype: Optional[np.dtype] = None,
    ndim: Optional[int] = None,
    num_outputs: Optional[int] = None,
) -> np.ndarray:
    """``value`` as a sample array, or :class:`SampleError` saying what was expected.

    Accepts NumPy arrays and anything ``np.asarray`` turns into a numeric or
    bool array (scalars, nested lists of numbers, objects with
    ``__array__``). Rejects ``None``, strings, bytes and object arrays.
    """
    if isinstance(value, np.ndarray):
        array = value
    elif value is None or isinstance(value, (str, bytes, bytearray)):
        hint = " (wrap bytes with np.frombuffer(data, np.uint8))" if isinstance(
            value, (bytes, bytearray)) else ""
        raise SampleError(
            f"{where}, output {output}: expected a NumPy array of numbers, got "
            f"{_describe_value(value)}{hint}"
        )
    else:
        if (
            num_outputs is None
            and isinstance(value, (tuple, list))
            and any(isinstance(item, np.ndarray) for item in value)
        ):
            raise SampleError(
                f"{where}, output {output}: expected one array, got {_describe_value(value)}; "
                f"to return {len(value)} outputs per sample, pass num_outputs={len(value)}"
            )
        try:
            array = np.asarray(value)
        except Exception as exc:
            raise SampleError(
                f"{where}, output {output}: expected a NumPy array of numbers, got "
                f"{_describe_value(value)} ({type(exc).__name__}: {exc})"
            ) from None
    if array.dtype.kind not in _VALID_KINDS:
        raise SampleError(
            f"{where}, output {output}: expected a NumPy array of numbers or bools, got "
            f"{_describe_value(value)} (dtype {array.dtype})"
        )
    if dtype is not None and array.dtype != dtype:
        raise SampleError(
            f"{where}, output {output}: expected dtype {dtype} (as declared), got {array.dtype}"
        )
    if ndim is not None and array.ndim != ndim:
        raise SampleError(
            f"{where}, output {output}: expected {ndim} dimensions (as declared), got "
            f"{array.ndim} (shape {array.shape})"
        )
    return array


class OverflowArea:
    """This worker's own segment for one slot; holds the samples that missed their region."""

    def __init__(self, segment: Segment):
        self.segment = segment
        self.mapping = Mapping(segment.fd)
        self.cursor = 0
        self.batch_seq = -1

    def start_batch(self, batch_seq: int) -> None:
        # Tasks of one batch share the area; a new batch in this slot starts over
        # (the pool only reuses a slot after the consumer released it).
        if batch_seq != self.batch_seq:
            self.batch_seq = batch_seq
            self.cursor = 0

    def put(self, array: np.ndarray) -> int:
        """Copies ``array`` in; returns its byte offset in the segment."""
        offset = align(self.cursor)
        end = offset + array.nbytes
        if end > self.mapping.size:
            size = self.segment.reserve(max(end, 2 * self.mapping.size, _MIN_OVERFLOW))
            self.mapping.ensure(size)
        if array.nbytes:
            self.mapping.array(offset, array.dtype, array.shape)[...] = array
        self.cursor = end
        return offset

    @property
    def size(self) -> int:
        return self.mapping.size


class TaskWriter:
    """Writes the samples a worker produced for a task of one source."""

    def __init__(
        self,
        slot_segments: Sequence[Segment],
        overflow_segments: Sequence[Segment],
        num_outputs: Optional[int],
        dtypes: Tuple[Optional[np.dtype], ...],
        ndims: Tuple[Optional[int], ...],
        batch_size: int,
    ):
        self.batch_size = batch_size
        self.slot_maps = [Mapping(seg.fd) for seg in slot_segments]
        self.overflow = [OverflowArea(seg) for seg in overflow_segments]
        self.num_outputs = num_outputs
        self.dtypes = dtypes
        self.ndims = ndims

    def write(
        self, task: Task, columns: List[Sequence[object]], count: int, describe: Describe
    ) -> Tuple[Tuple[Placement, ...], int]:
        """Writes ``columns[j][k]`` (output ``j``, sample ``task.start + k``).

        Returns the per-output placements and the overflow segment's size.
        Raises :class:`SampleError` for an invalid sample and
        :class:`~extsrc.errors.SharedMemoryError` when memory runs out.
        """
        overflow = self.overflow[task.slot]
        overflow.start_batch(task.batch_seq)
        slot_map = self.slot_maps[task.slot]
        if task.slot_size:
            slot_map.ensure(task.slot_size)
        try:
            placements = tuple(
                self._write_output(task, j, column, count, slot_map, overflow, describe)
                for j, column in enumerate(columns)
            )
        except SharedMemoryError as exc:
            # Every slot holds a batch, and the first batch also fills the overflow.
            batch_bytes = sum(np.asarray(column[0]).nbytes for column in columns if count) * self.batch_size
            raise with_advice(exc, overflow.segment.kind, (len(self.slot_maps) + 1) * batch_bytes) from None
        return placements, overflow.size

    def _write_output(self, task, j, column, count, slot_map, overflow, describe) -> Placement:
        region: Optional[Region] = task.regions[j]
        in_place = None
        fits = max(0, min(count, task.stop - task.start))  # samples that have a place in the region
        if region is not None and fits:
            offset, dtype_str, shape = region
            in_place = slot_map.array(
                offset + task.start * sample_nbytes(dtype_str, shape), np.dtype(dtype_str),
                (task.stop - task.start,) + shape,
            )
            if fits == count and self._write_dense(column, in_place[:count]):
                return None
        return self._write_each(task, j, column, count, in_place, fits, overflow, describe)

    @staticmethod
    def _write_dense(column, destination: np.ndarray) -> bool:
        """Fast path: every sample has the region's dtype and shape; one C-level copy."""
        if isinstance(column, np.ndarray):
            if column.dtype != destination.dtype or column.shape != destination.shape:
                return False
            destination[...] = column
            return True
        try:
            np.stack(column, out=destination, casting="no")
        except (ValueError, TypeError):
            return False
        return True

    def _write_each(self, task, j, column, count, in_place, fits, overflow, describe) -> Placement:
        dtype, ndim = self.dtypes[j], self.ndims[j]
        first: Optional[np.ndarray] = None
        placed = []
        for k in range(count):
            where = describe(task.start + k)
            try:
                array = to_sample_array(column[k], j, where, dtype, ndim, self.num_outputs)
            except SampleError as exc:
                exc.position = task.start + k
                raise
            if first is None:
                first = array
            elif array.dtype != first.dtype or array.ndim != first.ndim:
                raise _at(task.start + k, SampleError(
                    f"{where}, output {j}: expected dtype {first.dtype} and {first.ndim} "
                    f"dimensions like sample {describe(task.start)}, got dtype {array.dtype} "
                    f"with shape {array.shape}; all samples of an output in a batch must share "
                    "dtype and number of dimensions"
                ))
            if (
                in_place is not None
                and k < fits
                and array.dtype == in_place.dtype
                and array.shape == in_place.shape[1:]
            ):
                in_place[k] = array
                placed.append((array.dtype.str, array.shape, -1))
            else:
                placed.append((array.dtype.str, array.shape, overflow.put(array)))
        if in_place is not None and count == fits and all(p[2] < 0 for p in placed):
            return None
        return tuple(placed)


def _at(position: int, error: SampleError) -> SampleError:
    error.position = position  # lets the consumer order it against an earlier StopIteration
    return error
