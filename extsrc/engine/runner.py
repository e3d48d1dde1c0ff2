"""Running one source's callback for a task, inside a worker.

:class:`SourceRunner` calls the callback for each ``SampleInfo`` of the
task's range (sample mode) or once for the batch (batch mode), hands the
outputs to the writer, and answers with a :class:`~extsrc.engine.protocol.TaskDone`
or :class:`~extsrc.engine.protocol.TaskFailed`. Anything the callback raises,
``BaseException`` included (``SystemExit``, ``KeyboardInterrupt``), becomes a
``TaskFailed`` with its type, message, traceback and the sample it came from;
the worker carries on.
"""

from __future__ import annotations

import inspect
import pickle
import time
import traceback
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from extsrc.engine.protocol import SourceSetup, Task, TaskDone, TaskFailed
from extsrc.engine.samples import SampleChecker, at
from extsrc.errors import ExtsrcError, SampleError, SharedMemoryError
from extsrc.order import RecordCache
from extsrc.shm.writer import TaskWriter
from extsrc.sample_info import BatchInfo, SampleInfo

SAMPLE, BATCH_CALLABLE, BATCH_ITERABLE, BATCH_GENERATOR = "sample", "callable", "iterable", "generator"

Result = Union[TaskDone, TaskFailed]


def classify(source: Any, batch: bool) -> str:
    """The kind of a source; raises ``TypeError`` for one that fits no mode."""
    if not batch:
        if not callable(source):
            raise TypeError(
                f"in sample mode (batch=False) the source must be a callable taking a "
                f"SampleInfo, got {type(source).__name__}; iterables and generators need batch=True"
            )
        return SAMPLE
    if inspect.isgeneratorfunction(source):
        return BATCH_GENERATOR
    if callable(source):
        return BATCH_CALLABLE
    if hasattr(source, "__iter__"):
        return BATCH_ITERABLE
    raise TypeError(
        f"the source must be a callable, an iterable or a generator function, got "
        f"{type(source).__name__}"
    )


class ExhaustedIteratorError(SampleError):
    """A one-pass iterator (e.g. a generator object) was asked for a second epoch."""


# Samples of a task wait in the worker until this many bytes of them do, then are written to
# shared memory: small samples in one copy per task, large ones each as soon as it is made.
STREAM_BYTES = 1 << 20
# A task whose samples, sized like its first one, stay this many times under STREAM_BYTES is
# gathered without counting bytes per sample (that count cost ~10% on 1 KiB samples). A later
# sample far larger than the first is then written with the task's others, as before streaming.
SMALL_TASK_FACTOR = 2


def _nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (tuple, list)):
        return sum(v.nbytes for v in value if isinstance(v, np.ndarray))
    return 0


def _no_clock() -> int:
    return 0


class SampleBuffers:
    """What an ``in_place=True`` callback gets as its second argument: room in shared memory.

    ``buffers.array(shape, dtype, output=0)`` is a writable array for the
    sample being made, in the batch's shared memory: the callback fills it
    (e.g. ``file.readinto(buffers.array(size, np.uint8))``) and returns it, and
    the sample is then not copied. It is the sample's place in the batch's
    dense array when shape and dtype are those of the output's earlier
    samples, else room of its own. Valid until the callback returns; a
    callback may still return another array instead (it is then copied).
    Raises :class:`~extsrc.errors.SampleError` for a dtype or ndim other than
    the declared ones.
    """

    __slots__ = ("write", "position")

    def __init__(self) -> None:
        self.write: Any = None
        self.position = 0

    def array(self, shape: Any, dtype: Any = np.uint8, output: int = 0) -> np.ndarray:
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise ValueError(f"buffers.array: a shape of sizes >= 0, got {shape}")
        return self.write.alloc(output, self.position, shape, np.dtype(dtype))


class SourceRunner:
    """Runs the tasks of one source inside a worker."""

    def __init__(self, setup: SourceSetup, callback: Any, worker: int):
        self.setup = setup
        self.worker = worker
        self.callback = callback
        checker = SampleChecker(setup.num_outputs, setup.dtypes, setup.ndims)
        self.writer = TaskWriter(f"source {setup.name}", checker, setup.batch_size)
        self.iterator: Any = None
        self.iterator_epoch = -1
        self.one_pass_ended = False  # the source is its own iterator, and it ran out
        # The running pass is the source itself again after it ran out: its __iter__ may have
        # started a new pass (and returned self), or not; its first next() tells.
        self.retried_pass = False
        self.records = None if setup.order is None else RecordCache(setup.order)
        self.seed = 0 if setup.order is None else setup.order.seed
        self.buffers = SampleBuffers() if setup.in_place else None
        self.clock = time.perf_counter_ns if setup.timed else _no_clock

    def run(self, task: Task) -> Result:
        """Runs one task; returns a :class:`TaskDone` or :class:`TaskFailed`."""
        if self.setup.kind == SAMPLE:
            return self._run_samples(task)
        return self._run_batch(task)

    # -- sample mode ---------------------------------------------------------------------------

    def _run_samples(self, task: Task) -> Result:
        callback = self.callback
        base = task.iteration * self.setup.batch_size
        first, last = base + task.start, base + task.stop
        records, stopped = self._records(task.epoch_idx, first, last)
        seed = self.seed
        make = tuple.__new__

        def describe(pos: int) -> str:
            return f"sample {self._info(task, pos)}"

        write = self.writer.begin(task.slot_id, task.batch_seq, task.start, task.stop,
                                  task.region_bytes, task.regions, describe)
        buffers = self.buffers
        if buffers is None:
            produce = callback
        else:
            buffers.write = write

            def produce(info: SampleInfo) -> Any:
                buffers.position = info.idx_in_batch
                return callback(info, buffers)
        iteration, epoch_idx = task.iteration, task.epoch_idx
        # Samples wait here until STREAM_BYTES of them do, then go to shared memory: small
        # ones in one copy per task, large ones one by one (the callback's memory is then
        # reused for the next sample instead of being faulted in anew).
        waiting: List[Any] = []
        waiting_bytes = 0
        chunk_start = task.start
        position = task.start
        positions = zip(range(task.start, task.stop), records)
        # The callback is timed per group of samples written together (clock reads per group,
        # not per sample: the statistics cost nothing measurable).
        clock = self.clock
        timed: List[Tuple[int, int]] = []
        began = group_began = clock()
        writing = False  # whether an exception comes from writing samples, not from the callback
        try:
            for position, record in positions:
                value = produce(make(SampleInfo, (base + position, position, iteration, epoch_idx,
                                                  record, seed)))
                waiting.append(value)
                waiting_bytes += _nbytes(value)
                if waiting_bytes >= STREAM_BYTES:
                    timed.append((len(waiting), clock() - group_began))
                    writing = True
                    self._flush(write, waiting, chunk_start)
                    writing = False
                    chunk_start += len(waiting)
                    waiting, waiting_bytes = [], 0
                    group_began = clock()
                elif (len(waiting) == 1 and chunk_start == task.start
                      and waiting_bytes * (task.stop - task.start) * SMALL_TASK_FACTOR < STREAM_BYTES):
                    break  # samples like the first one: the rest go without counting bytes
            append = waiting.append
            for position, record in positions:
                append(produce(make(SampleInfo, (base + position, position, iteration, epoch_idx,
                                                 record, seed))))
        except StopIteration:
            stopped = True
        except SampleError as exc:
            return self._failed(task, getattr(exc, "position", position), None, exc, from_callback=False)
        except SharedMemoryError as exc:
            return self._failed(task, position, None, exc, from_callback=False)
        except BaseException as exc:
            if writing:
                return self._write_failed(task, chunk_start, exc)
            return self._failed(task, position, self._info(task, position), exc)
        if waiting:
            timed.append((len(waiting), clock() - group_began))
        try:
            self._flush(write, waiting, chunk_start)
            count = chunk_start - task.start + len(waiting)
            return self._done(task, write, count, stopped, clock() - began, tuple(timed))
        except Exception as exc:
            return self._write_failed(task, chunk_start, exc)

    def _flush(self, write: Any, waiting: List[Any], chunk_start: int) -> None:
        if waiting:
            write.add(self._columns_of_samples(waiting, chunk_start, write.describe), chunk_start,
                      len(waiting))

    def _records(self, epoch_idx: int, first: int, last: int) -> Tuple[Sequence[int], bool]:
        """The records of positions ``first..last-1``, and whether the epoch ends before ``last``.

        Without an order a record is its position. With one, positions past the
        shard's epoch are the end of it, or, with ``last_batch="pad"``, records
        from the start of the epoch's order again.
        """
        if self.records is None:
            return range(first, last), False
        length = len(self.setup.order)
        if last <= length:
            return self.records.get(epoch_idx, first, last), False
        if self.setup.last_batch != "pad":
            return self.records.get(epoch_idx, first, max(first, length)), True
        records = self.records.get(epoch_idx, first, length) if first < length else []
        for position in range(max(first, length), last):  # at most the rest of one batch
            wrapped = position % length
            records += self.records.get(epoch_idx, wrapped, wrapped + 1)
        return records, False

    def _info(self, task: Task, position: int) -> SampleInfo:
        idx = task.iteration * self.setup.batch_size + position
        records, _ = self._records(task.epoch_idx, idx, idx + 1)
        record = records[0] if len(records) else idx
        return SampleInfo(idx, position, task.iteration, task.epoch_idx, record, self.seed)

    def _columns_of_samples(self, produced, start, describe) -> List[Sequence[Any]]:
        num_outputs = self.setup.num_outputs
        if num_outputs is None:
            return [produced]
        for k, sample in enumerate(produced):
            if not isinstance(sample, (tuple, list)) or len(sample) != num_outputs:
                got = (
                    f"a {type(sample).__name__} of {len(sample)} outputs"
                    if isinstance(sample, (tuple, list))
                    else f"one {type(sample).__name__}"
                )
                raise at(start + k, SampleError(
                    f"{describe(start + k)}: expected a tuple of {num_outputs} outputs "
                    f"(num_outputs={num_outputs}), got {got}"
                ))
        if not produced:
            return [[] for _ in range(num_outputs)]
        return [list(column) for column in zip(*produced)]

    # -- batch mode ----------------------------------------------------------------------------

    def _run_batch(self, task: Task) -> Result:
        setup = self.setup
        info = BatchInfo(task.iteration, task.epoch_idx)
        began = self.clock()
        try:
            if setup.kind == BATCH_CALLABLE:
                batch = self.callback(info if setup.batch_info else task.iteration)
            else:
                batch = next(self._iterator_for(task.epoch_idx))
                self.retried_pass = False
        except StopIteration:
            if self.iterator is self.callback:
                self.one_pass_ended = True
            if self.retried_pass:
                self.retried_pass = False
                return self._failed(task, 0, info, self._exhausted(task.epoch_idx), from_callback=False)
            return TaskDone(task.source_id, task.ticket, self.worker, 0, True, (), 0)
        except BaseException as exc:
            return self._failed(task, 0, info, exc)

        def describe(pos: int) -> str:
            return f"sample {pos} of batch {info}"  # batch mode: no SampleInfo

        took = self.clock() - began
        try:
            columns = self._columns_of_batch(batch, info)
            count = len(columns[0])
            write = self.writer.begin(task.slot_id, task.batch_seq, 0, task.stop, task.region_bytes,
                                      task.regions, describe)
            write.add(columns, 0, count)
            return self._done(task, write, count, False, self.clock() - began, ((count, took),))
        except Exception as exc:
            return self._failed(task, getattr(exc, "position", 0), info, exc, from_callback=False)

    # -- what the worker does with the written samples -----------------------------------------

    def _done(self, task: Task, write: Any, count: int, stopped: bool, busy_ns: int,
              timed: Tuple[Tuple[int, int], ...]) -> Any:
        """The answer to ``task`` once its ``count`` samples went to ``write`` (what
        ``self.writer.begin`` gave). Another backend may deliver them otherwise (Ray actors
        return them, see :mod:`extsrc.ray.actor`). Raises what the writer raises."""
        spilled, overflow = write.finish()
        return TaskDone(task.source_id, task.ticket, self.worker, count, stopped, spilled, overflow,
                        busy_ns, timed)

    def _iterator_for(self, epoch_idx: int):
        if self.iterator_epoch != epoch_idx:
            source = self.callback
            if self.setup.kind == BATCH_GENERATOR:
                self.iterator = source()
            else:
                # Every epoch calls iter() again: an iterable whose __iter__ resets its state and
                # returns itself starts a new pass (DALI does the same after each reset()).
                self.iterator = iter(source)
                self.retried_pass = self.one_pass_ended and self.iterator is source
            self.iterator_epoch = epoch_idx
        return self.iterator

    def _exhausted(self, epoch_idx: int) -> ExhaustedIteratorError:
        source = self.callback
        return ExhaustedIteratorError(
            f"source {self.setup.name}: the source is a one-pass iterator "
            f"({type(source).__name__}, e.g. a generator object) that ran out in an "
            f"earlier epoch, and iter() on it did not start a new pass, so epoch {epoch_idx} "
            "is empty. Pass the generator function itself (source=gen, not gen()), or an "
            "iterable whose __iter__ starts a new pass"
        )

    def _columns_of_batch(self, batch, info: BatchInfo) -> List[Sequence[Any]]:
        num_outputs = self.setup.num_outputs
        if num_outputs is None:
            columns = [batch]
        elif isinstance(batch, (tuple, list)) and len(batch) == num_outputs:
            columns = list(batch)
        else:
            got = (
                f"a {type(batch).__name__} of {len(batch)} items"
                if isinstance(batch, (tuple, list))
                else f"{type(batch).__name__}"
            )
            raise SampleError(
                f"batch {info}: expected a tuple of {num_outputs} batches "
                f"(num_outputs={num_outputs}), got {got}"
            )
        lengths = []
        for j, column in enumerate(columns):
            if isinstance(column, np.ndarray) and column.ndim >= 1 and column.dtype.kind != "O":
                lengths.append(len(column))
            elif isinstance(column, (list, tuple)):
                lengths.append(len(column))
            else:
                raise SampleError(
                    f"batch {info}, output {j}: expected a list of sample arrays or one array "
                    f"with the samples along its first axis, got {type(column).__name__}"
                )
        if len(set(lengths)) > 1:
            raise SampleError(f"batch {info}: the outputs have different numbers of samples: {lengths}")
        if lengths[0] > self.setup.batch_size:
            raise SampleError(
                f"batch {info}: the source returned {lengths[0]} samples, more than "
                f"batch_size={self.setup.batch_size}"
            )
        if lengths[0] == 0:
            raise SampleError(
                f"batch {info}: the source returned an empty batch; raise StopIteration to end "
                "the epoch instead"
            )
        return columns

    # -- failures ------------------------------------------------------------------------------

    def _failed(self, task: Task, position: int, where: Optional[Any], exc: BaseException,
                from_callback: bool = True) -> TaskFailed:
        return failure(task, self.worker, position, where, exc, from_callback)

    def _write_failed(self, task: Task, chunk_start: int, exc: BaseException) -> TaskFailed:
        """``exc`` came from checking or writing the samples from ``chunk_start`` on. extsrc's
        own errors name their sample; any other is tied to the first sample of the chunk."""
        if isinstance(exc, ExtsrcError):
            return self._failed(task, getattr(exc, "position", chunk_start), None, exc, from_callback=False)
        return self._failed(task, chunk_start, self._info(task, chunk_start), exc, from_callback=False)

    def close(self) -> None:
        self.writer.close()


def failure(task: Task, worker: int, position: int, where: Optional[Any], exc: BaseException,
            from_callback: bool = True) -> TaskFailed:
    """The :class:`TaskFailed` of ``task`` for ``exc``, raised at sample ``position`` (``where``:
    its ``SampleInfo``/``BatchInfo``, if tied to one) by the callback or, if not
    ``from_callback``, by checking or writing its output."""
    tb = exc.__traceback__
    if from_callback and tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # start at the callback, not at the worker's loop
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        payload: Optional[bytes] = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(payload)
    except Exception:
        payload = None
    return TaskFailed(
        task.source_id, task.ticket, worker, position, where, payload,
        type(exc).__qualname__, str(exc), text, from_callback,
    )
