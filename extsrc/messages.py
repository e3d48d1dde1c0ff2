"""Control messages between the pool and its workers.

They carry task ranges, offsets, shapes and dtypes, never sample bytes: the
samples themselves are in shared memory (see :mod:`extsrc.slots`). Messages
are pickled tuples sent over one socket pair per worker.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import numpy as np

# Where one output's samples of a batch go in the slot segment: the byte offset
# of the output's region, its sample dtype (``dtype.str``) and sample shape.
# Sample ``k`` of the batch lives at ``offset + k * sample_nbytes(dtype, shape)``.
Region = Tuple[int, str, Tuple[int, ...]]


def sample_nbytes(dtype_str: str, shape: Tuple[int, ...]) -> int:
    """Bytes of one sample of dtype ``dtype_str`` and ``shape``: a region's stride."""
    nbytes = np.dtype(dtype_str).itemsize
    for extent in shape:
        nbytes *= extent
    return nbytes


class Task(NamedTuple):
    """Produce samples ``[start, stop)`` of one batch of one source.

    In batch mode the range is ``[0, capacity)`` and the callback decides the
    batch length. ``regions[j]`` is where output ``j`` is written in place, or
    ``None`` while its shape is unknown (then every sample goes to the worker's
    overflow segment for the slot).
    """

    source_id: int
    ticket: int
    batch_seq: int
    epoch_idx: int
    iteration: int
    start: int
    stop: int
    slot: int
    slot_size: int
    regions: Tuple[Optional[Region], ...]


# Placement of one output's samples produced by a task: ``None`` means all of
# them were written in place in the region of the task's ``regions`` entry.
# Otherwise a tuple of per-sample ``(dtype_str, shape, offset)`` where
# ``offset < 0`` means "in place in the region" and ``offset >= 0`` is a byte
# offset in the worker's overflow segment for the slot.
Placement = Optional[Tuple[Tuple[str, Tuple[int, ...], int], ...]]


class TaskDone(NamedTuple):
    """The task produced ``count`` samples; ``stopped`` if StopIteration came after them."""

    source_id: int
    ticket: int
    worker: int
    count: int
    stopped: bool
    placements: Tuple[Placement, ...]
    overflow_size: int


class TaskFailed(NamedTuple):
    """The task failed at ``position`` (idx_in_batch); earlier samples are lost with it.

    ``error`` is the pickled exception when it pickles (else ``None``);
    ``type_name``/``message``/``traceback`` always describe it. ``where`` is
    the ``SampleInfo``/``BatchInfo`` of the failing call. ``in_callback`` is
    false when the callback returned but its output was invalid.
    """

    source_id: int
    ticket: int
    worker: int
    position: int
    where: object
    error: Optional[bytes]
    type_name: str
    message: str
    traceback: str
    in_callback: bool


class WorkerSetupFailed(NamedTuple):
    """The worker could not load its sources (unpickling, ``__setstate__``)."""

    worker: int
    message: str
    traceback: str


STOP = None  # sent to a worker: finish and exit
