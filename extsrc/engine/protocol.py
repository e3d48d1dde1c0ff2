"""The messages between a pool and its workers, and what a worker is given at start.

Messages are typed records with named fields (``NamedTuple``: they pickle
small and fast). They carry ranges, offsets, shapes and dtypes, never sample
bytes: samples are in shared memory. Each worker has one channel
(:mod:`extsrc.engine.channel`); messages on it arrive in the order sent.

Pool -> worker: :class:`AddSlot` (with descriptors), :class:`DropSlot`,
:class:`Task`, :class:`Stop`. Worker -> pool: :class:`TaskDone`,
:class:`TaskFailed`, :class:`SetupFailed`. A worker sees a slot's
:class:`AddSlot` before any task for it, and its :class:`DropSlot` only
after every task for it has reported back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Tuple, Union

from extsrc.engine.faults import SampleFault
from extsrc.engine.hooks import WorkerHooks
from extsrc.engine.kinds import SourceKind
from extsrc.shm.layout import Region, Spilled

if TYPE_CHECKING:
    from extsrc.engine.pickling import Pickler
    from extsrc.order import Order
    from extsrc.sample_info import BatchInfo, SampleInfo


# -- pool -> worker ---------------------------------------------------------------------------


class AddSlot(NamedTuple):
    """A new slot of a source; sent with two descriptors: its region segment, and the
    receiving worker's own overflow segment of it."""

    source_id: int
    slot_id: int
    kind: str  # the segments' backend ("memfd", "devshm"), for error messages


class DropSlot(NamedTuple):
    """The slot is retired: close and unmap it."""

    source_id: int
    slot_id: int


class Task(NamedTuple):
    """Produce samples ``[start, stop)`` of one batch of one source into slot ``slot_id``.

    In batch mode the range is ``[0, batch_size)`` and the callback decides
    the batch length. ``regions[j]`` is where output ``j`` is written in
    place, or ``None`` while its layout is not known (then all its samples go
    to overflow). ``region_bytes``: how much of the region segment is in use.
    ``give_back``: the worker may give back overflow memory the batch does not
    need (not while the consumer page-locks the slots' memory for DMA: a
    registration would keep reading the pages given back).
    """

    source_id: int
    ticket: int
    slot_id: int
    batch_seq: int  # unique per batch dispatched; a worker's overflow area starts over at a new one
    epoch_idx: int
    iteration: int
    start: int
    stop: int
    region_bytes: int
    give_back: bool
    regions: Tuple[Optional[Region], ...]


class Stop(NamedTuple):
    """Finish and exit."""


# -- worker -> pool ---------------------------------------------------------------------------


class TaskDone(NamedTuple):
    """The task produced ``samples`` samples (``stopped``: the epoch ended right after them).

    ``spilled[j]`` lists the samples of output ``j`` that went to overflow;
    every other sample is in place in its region. ``overflow_bytes`` is how
    much of the worker's overflow segment the parent must map to read them.
    """

    source_id: int
    ticket: int
    worker: int
    samples: int  # not ``count``, which would hide tuple.count
    stopped: bool
    spilled: Tuple[Tuple[Spilled, ...], ...]
    overflow_bytes: int
    busy_ns: int = 0  # the task's time in the worker
    timed: Tuple[Tuple[int, int], ...] = ()  # (samples, ns the callback took for them), per group
    waited_ns: int = 0  # the sum over its samples of their time in flight (busy_ns one at a time)
    cpu_ns: int = -1  # the worker's CPU time so far, cumulative (-1: not read with this task)
    runq_ns: int = -1  # its main thread's time waiting for a CPU so far, cumulative (-1: unknown)
    notes: Tuple[str, ...] = ()  # warnings for the user, raised once by the consumer
    faults: Tuple[SampleFault, ...] = ()  # samples skipped or replaced (extsrc.engine.faults)


class TaskFailed(NamedTuple):
    """The task failed at ``position`` (idx_in_batch); its earlier samples are lost with it.

    ``error`` is the pickled exception when it pickles (else ``None``);
    ``type_name``/``message``/``traceback`` always describe it. ``where`` is
    the ``SampleInfo``/``BatchInfo`` of the failing call, ``None`` when the
    failure is not tied to one. ``in_callback``: raised by the callback
    (rather than by checking or writing its output).
    """

    source_id: int
    ticket: int
    worker: int
    position: int
    where: Union[SampleInfo, BatchInfo, None]
    error: Optional[bytes]
    type_name: str
    message: str
    traceback: str
    in_callback: bool


Result = Union[TaskDone, TaskFailed]  # a task's answer


class SetupFailed(NamedTuple):
    """The worker could not load its sources (unpickling, ``__setstate__``)."""

    worker: int
    message: str
    traceback: str


ToWorker = Union[AddSlot, DropSlot, Task, Stop]  # what a pool sends a worker
FromWorker = Union[TaskDone, TaskFailed, SetupFailed]  # what a worker sends its pool
Message = Union[ToWorker, FromWorker]


# -- on the wire ------------------------------------------------------------------------------

# The two messages of every batch travel as plain tuples led by a tag, their regions as plain
# tuples too: pickle then writes no class references (a Task pickles and unpickles in ~1.7 us
# instead of ~4.1, a TaskDone in ~0.8 instead of ~2.6). A TaskDone's spilled samples (one per
# ragged sample) go as plain tuples as well: 128 of them pickled and unpickled in ~86 us
# instead of ~237 (ragged 64-320 int32 samples: about 1.2 us of a worker's CPU per sample).
# Any other message pickles as itself.
_TASK_TAG = 1
_TASK_DONE_TAG = 2


def to_wire(message: Message) -> Tuple[object, ...]:
    """What :mod:`extsrc.engine.channel` pickles for ``message``; :func:`from_wire` undoes it."""
    if message.__class__ is Task:
        regions = tuple(None if r is None else tuple(r) for r in message.regions)
        return (_TASK_TAG,) + message[:-1] + (regions,)
    if message.__class__ is TaskDone:
        if any(message.spilled):
            plain = tuple(tuple(map(tuple, out)) for out in message.spilled)
            return (_TASK_DONE_TAG,) + message[:_SPILLED] + (plain,) + message[_SPILLED + 1:]
        return (_TASK_DONE_TAG,) + message
    return message


def from_wire(value: Any) -> Message:
    """The message that :func:`to_wire` turned into ``value`` (as unpickled)."""
    if value.__class__ is not tuple:
        message: Message = value  # one that pickles as itself (a NamedTuple)
        return message
    if value[0] == _TASK_TAG:
        regions = tuple(None if r is None else _new(Region, r) for r in value[-1])
        return _new(Task, value[1:-1] + (regions,))
    if value[0] == _TASK_DONE_TAG:
        done: TaskDone = _new(TaskDone, value[1:])
        if any(done.spilled):
            done = done._replace(spilled=tuple(tuple(map(_spilled, out)) for out in done.spilled))
        return done
    raise ValueError(f"a message of unknown kind came over a channel: tag {value[0]!r}")


_new = tuple.__new__  # a NamedTuple from its fields, without the checks of its __new__
_spilled = functools.partial(_new, Spilled)
_SPILLED = TaskDone._fields.index("spilled")


# -- what a worker is given at start ----------------------------------------------------------


@dataclass(frozen=True)
class SourceSetup:
    """What a worker needs to run one source; built once per source at pool start."""

    source_id: int
    name: str
    kind: SourceKind  # see extsrc.engine.kinds
    callback: Any  # the source (fork), or its pickled bytes (spawn, forkserver)
    pickled: bool
    batch_size: int
    num_outputs: Union[None, int, str]  # as in SourceSpec: None, a count, or AUTO_OUTPUTS
    dtypes: Tuple[Optional[str], ...]
    ndims: Tuple[Optional[int], ...]
    order: Optional[Order] = None  # which record each position of an epoch loads
    last_batch: str = "drop"
    in_place: bool = False  # the callback gets SampleBuffers to write its samples into
    timed: bool = True  # report how long the callback takes (extsrc.engine.stats)
    concurrency: int = 1  # samples in flight at once per worker (extsrc.engine.concurrent)
    timeout: Optional[float] = None  # a sample in flight longer fails its batch (concurrency > 1)
    slots_kept: int = 0  # batches of memory the source keeps (prefetch + batches_held), for the
    # memory check at the first sample (extsrc.shm.limits.check_source_need); 0: not known
    # What the worker runs around the callback (extsrc.engine.hooks). When `hooks_pickled`, its
    # code (worker_init, begin_epoch) was pickled with the callback, as (callback, worker_init,
    # begin_epoch), and `hooks` holds the rest.
    hooks: WorkerHooks = WorkerHooks()
    hooks_pickled: bool = False
    num_workers: int = 1


@dataclass(frozen=True)
class WorkerSetup:
    """Everything a worker process is started with."""

    index: int
    parent_pid: Optional[int]  # None: the parent is a fork server, whatever it is at start
    forked: bool  # started with fork: drop what was inherited from the parent
    die_with_parent: bool  # PR_SET_PDEATHSIG is reliable (started from the main thread)
    sources: Tuple[SourceSetup, ...]
    pickler: Optional[Pickler]  # None with fork

