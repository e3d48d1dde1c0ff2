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

import errno
import os
import pickle
import math
import time
import traceback
import types
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Type, Union

import numpy as np

from extsrc.arrays import Array
from extsrc.engine.policy import SMALL_TASK_FACTOR, STREAM_BYTES
from extsrc.engine.faults import SKIPPED, SampleFault, fault_of, faults_of_task, guarded
from extsrc.engine.concurrent import AsyncEngine, Deliver, Hung, Job, Outcome, ThreadEngine, is_async
from extsrc.engine.pickling import Pickler, dumps_exception
from extsrc.engine.protocol import Result, SourceSetup, Task, TaskDone, TaskFailed
from extsrc.engine.samples import SampleChecker, at
from extsrc.engine.hooks import WorkerHooks
from extsrc.engine.kinds import BATCH_CALLABLE, BATCH_GENERATOR, SAMPLE, Source
from extsrc.engine.sink import Describe, TaskSink, WriterSink
from extsrc.errors import (EpochLengthError, ExhaustedIteratorError, ExtsrcError, SampleError,
                           SharedMemoryError, SourceTimeoutError)
from extsrc.engine.spec import AUTO_OUTPUTS
from extsrc.order import RecordCache
from extsrc.shm.limits import format_bytes
from extsrc.shm.writer import TaskWriter
from extsrc.sample_info import BatchInfo, SampleInfo, noting_sample_info

# With samples in flight together, a sample in flight longer than this share of the source's
# timeout fails its batch in the worker, which knows which sample hangs and where it waits. The
# consumer's clock for a batch starts when it asks for the batch, often before the batch's samples
# start: with the whole timeout the consumer would nearly always give up first, naming only a task.
SAMPLE_TIMEOUT_SHARE = 0.8


def _nbytes(value: object) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (tuple, list)):
        return sum(v.nbytes for v in value if isinstance(v, np.ndarray))
    return 0


def _column_of_samples(column: Array) -> Union[Array, List[Array]]:
    """A batch-mode output given as one array, as what its samples are: a subclass seen as a
    plain array (a MaskedArray's data, not its ``masked`` constant for a masked element), and a
    1-D array of another byte order as 0-d views (its elements would be native NumPy scalars)."""
    if type(column) is not np.ndarray:
        column = column.view(np.ndarray)
    if column.ndim == 1 and not column.dtype.isnative:
        return [column[k, ...] for k in range(len(column))]
    return column


def _bound_call(callback: Callable[..., Any]) -> Callable[..., Any]:
    """``callback``, or for an instance of a class whose ``__call__`` is a Python function (as
    DALI's examples write callbacks, and ``from_dataset``'s), that function bound to it: the
    same call, without looking up ``__call__`` again for every sample (about 0.1 us each)."""
    for klass in type(callback).__mro__:
        call = klass.__dict__.get("__call__")
        if call is not None:  # a plain function binds; a staticmethod or other descriptor not
            return types.MethodType(call, callback) if type(call) is types.FunctionType else callback
    return callback


def _no_clock() -> int:
    return 0


# The worker's CPU counters are read at most this often (a read costs a few microseconds, up to
# ~10 under load: per task it would show on small samples); they are cumulative, so nothing is lost.
CPU_READ_PERIOD_NS = 50_000_000


class CpuClock:
    """This source's CPU time in this worker and its main thread's time waiting for a CPU, both
    cumulative estimates (ns).

    The process's counters cover everything the worker does, for every source it serves (a
    shared pool) and between tasks, so they are read around one of this source's tasks at
    most every :data:`CPU_READ_PERIOD_NS` (:meth:`task_begins`, :meth:`task_ran`): that task's
    CPU time over its busy time is the rate for this source's busy time since the previous
    reading. The statistics take differences between readings, and tell a callback that waits
    on I/O (neither) from one starved of CPU (waiting for a CPU).
    """

    def __init__(self) -> None:
        try:
            self.fd: Optional[int] = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.fd = None
        self.last = -CPU_READ_PERIOD_NS
        self.start: Optional[Tuple[int, int]] = None  # the counters when the measured task began
        self.own_busy = 0  # this source's busy ns since the last reading
        self.cpu = self.runq = 0  # the estimates so far

    def _counters(self) -> Tuple[int, int]:
        runq = 0
        if self.fd is not None:
            try:
                runq = int(os.pread(self.fd, 128, 0).split()[1])
            except (OSError, ValueError, IndexError):
                runq = 0
        return time.process_time_ns(), runq

    def task_begins(self) -> None:
        """A task of this source begins: measured when the last reading is old enough."""
        now = time.perf_counter_ns()
        if now - self.last >= CPU_READ_PERIOD_NS:
            self.last = now
            self.start = self._counters()

    def task_ran(self, busy_ns: int) -> Tuple[int, int]:
        """The task kept the worker busy ``busy_ns``: the estimates if it was measured, else
        ``(-1, -1)``."""
        self.own_busy += busy_ns
        start, self.start = self.start, None
        if start is None:
            return -1, -1
        end = self._counters()
        if busy_ns > 0:
            self.cpu += (end[0] - start[0]) * self.own_busy // busy_ns
            self.runq += max(0, end[1] - start[1]) * self.own_busy // busy_ns
        self.own_busy = 0
        return self.cpu, self.runq

    def close(self) -> None:
        fd, self.fd = self.fd, None  # forgotten first, as in extsrc.shm.segment.Segment.close
        if fd is not None:
            os.close(fd)


# No sample asks for this much in earnest (2**48 bytes, 256 TiB): a larger buffers.array() is
# a wrong shape, refused before any size arithmetic can overflow.
MAX_BUFFER_BYTES = 1 << 48


class SampleBuffers:
    """What an ``in_place=True`` callback gets as its second argument: room in shared memory.

    ``buffers.array(shape, dtype, output=0)`` is a writable array for the
    sample being made, in the batch's shared memory: the callback fills it
    (e.g. ``file.readinto(buffers.array(size, np.uint8))``) and returns it, and
    the sample is then not copied. It is the sample's place in the batch's
    dense array when shape and dtype are those of the output's earlier
    samples, else room of its own. Valid until the callback returns; a
    callback may still return another array instead (it is then copied).
    Raises :class:`~extsrc.errors.SampleError` for an ``output`` the source
    does not have, a shape that is not ints >= 0, something that is not a
    dtype, or a dtype or ndim other than the declared ones; and
    :class:`~extsrc.errors.SharedMemoryError` when the memory cannot be had.
    Each names the call, the sample and what was expected.
    """

    __slots__ = ("write", "position", "num_outputs")

    def __init__(self, num_outputs: Optional[int] = None) -> None:
        self.write: TaskSink  # the running task's (set by the runner before each call)
        self.position = 0
        self.num_outputs = 1 if num_outputs is None else num_outputs

    # The arguments are the callback's, checked here.
    def array(self, shape: Any, dtype: Any = np.uint8, output: int = 0) -> Array:
        if type(output) is not int or not 0 <= output < self.num_outputs:
            output = self._checked_output(shape, dtype, output)
        if type(shape) is int and shape >= 0:
            shape = (shape,)
        elif type(shape) is not tuple or not all(type(n) is int and n >= 0 for n in shape):
            shape = self._checked_shape(shape, dtype, output)
        try:
            dtype = np.dtype(dtype)
        except TypeError as exc:
            raise SampleError(self._where(shape, dtype, output) + f": expected a NumPy dtype, got "
                              f"{dtype!r} ({exc})") from None
        nbytes = dtype.itemsize * math.prod(shape)
        if nbytes > MAX_BUFFER_BYTES:
            raise SharedMemoryError(
                errno.ENOMEM, self._where(shape, dtype, output) + f": asks for "
                f"{format_bytes(nbytes)}, more than any machine has; check the shape")
        try:
            return self.write.alloc(output, self.position, shape, dtype)
        except SharedMemoryError as exc:
            raise SharedMemoryError(exc.errno, self._where(shape, dtype, output) + f" asks for "
                                    f"{format_bytes(nbytes)}: {exc.strerror}") from None

    def _checked_output(self, shape: object, dtype: object, output: object) -> int:
        """``output`` as an int (a NumPy integer), or the error naming the call and sample."""
        count = self.num_outputs
        if isinstance(output, np.integer) and 0 <= output < count:
            return int(output)
        expected = "0 (the source has 1 output)" if count == 1 else \
            f"an int from 0 to {count - 1} (the source has {count} outputs)"
        raise SampleError(self._where(shape, dtype, output) + f": expected output {expected}, "
                          f"got {output!r}")

    def _checked_shape(self, shape: Any, dtype: object, output: int) -> Tuple[int, ...]:
        """``shape`` as a tuple of ints (from NumPy integers, a list, an array), or the error."""
        try:
            dims = [shape] if np.ndim(shape) == 0 else list(shape)
            if all(isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_))
                   and n >= 0 for n in dims):
                return tuple(int(n) for n in dims)
        except TypeError:
            pass
        raise SampleError(self._where(shape, dtype, output) + ": expected a shape of ints >= 0 "
                          f"(an int or a sequence of them), got {shape!r}")

    def _where(self, shape: object, dtype: Any, output: object) -> str:
        """The call and the sample it was for, for an error (only then: describing costs)."""
        try:
            shown = np.dtype(dtype).name
        except TypeError:
            shown = repr(dtype)
        return (f"buffers.array({shape!r}, {shown}, output={output!r}) for "
                f"{self.write.describe(self.position)}")


def load_source(setup: SourceSetup, pickler: Optional[Pickler]) -> Tuple[Source, WorkerHooks]:
    """The source's callback and its worker hooks in a worker (unpickled if they were pickled)."""
    if not setup.pickled:
        return setup.callback, setup.hooks
    assert pickler is not None, "a pickled source comes with its pickler"
    loaded = pickler.loads(setup.callback)
    if not setup.hooks_pickled:
        return loaded, setup.hooks
    callback, worker_init, begin_epoch, on_error = loaded  # together: what they share stays shared
    return callback, WorkerHooks(worker_init, begin_epoch, setup.hooks.batch_info, on_error)


def slot_writer(setup: SourceSetup) -> TaskWriter:
    """The engine's writer sink for ``setup``: samples checked and written into the slots."""
    checker = SampleChecker(setup.num_outputs, setup.dtypes, setup.ndims)
    return TaskWriter(f"source {setup.name}", checker, setup.batch_size, setup.slots_kept)


class SourceRunner:
    """Runs the tasks of one source inside a worker.

    Made once per worker: it first calls the hooks' ``worker_init(worker, num_workers)``, if
    there is one; what that raises is the worker's setup failure. Its samples go to ``writer``
    (:mod:`extsrc.engine.sink`), by default the slots' shared memory.
    """

    def __init__(self, setup: SourceSetup, callback: Source, worker: int,
                 hooks: Optional[WorkerHooks] = None, writer: Optional[WriterSink] = None):
        hooks = WorkerHooks() if hooks is None else hooks
        if hooks.worker_init is not None:
            hooks.worker_init(worker, setup.num_workers)
        self.setup = setup
        self.hooks = hooks
        self.worker = worker
        self.callback = callback
        declared = None if isinstance(setup.num_outputs, str) else setup.num_outputs  # str: AUTO_OUTPUTS
        self.writer: WriterSink = slot_writer(setup) if writer is None else writer
        self.iterator: Iterator[object] = iter(())  # the pass of an iterable or generator
        self.iterator_epoch = -1
        self.one_pass_ended = False  # the source is its own iterator, and it ran out
        # The running pass is the source itself again after it ran out: its __iter__ may have
        # started a new pass (and returned self), or not; its first next() tells.
        self.retried_pass = False
        self.records = None if setup.order is None else RecordCache(setup.order)
        self.seed = 0 if setup.order is None else setup.order.seed
        self.buffers = SampleBuffers(declared) if setup.in_place else None
        self.clock = time.perf_counter_ns if setup.timed else _no_clock
        # Outputs per sample: declared, or (num_outputs="auto") those of this worker's first
        # sample; the consumer checks that every worker's agree.
        self.num_outputs = declared
        self.learns_outputs = setup.num_outputs == AUTO_OUTPUTS
        # Under an order that moves records, whether the callback reads idx_in_epoch but never
        # record: noted until it reads record or was warned about (then plain SampleInfo again).
        self.info_class: Type[SampleInfo] = SampleInfo
        self.reads: Optional[List[bool]] = None
        if setup.kind == SAMPLE and setup.order is not None and (
                setup.order.shuffle or setup.order.shard != (0, 1)):
            self.info_class, self.reads = noting_sample_info()
        self.cpu = CpuClock() if setup.timed else None
        # Samples in flight together (concurrency > 1, or an async def callback): the worker's
        # event loop or threads, made on first use (after the fork). None: one at a time.
        self.engine: Union[AsyncEngine, ThreadEngine, None] = None
        self.call_batch = callback
        self.sample_limit_s = None if setup.timeout is None else setup.timeout * SAMPLE_TIMEOUT_SHARE
        self.busy_until = 0  # the clock at the end of the last task whose busy time was counted
        self.faults: List[SampleFault] = []  # samples skipped or replaced, until their task answers
        if hooks.on_error is not None and setup.kind == SAMPLE:
            callback = self.callback = guarded(callback, hooks.on_error, self.faults, is_async(callback))
        self.sample_call = _bound_call(callback)  # what a task in sample mode calls per sample
        if is_async(callback):
            self.engine = AsyncEngine(callback, setup.concurrency)
            self.call_batch = self.engine.call
        elif setup.kind == SAMPLE and setup.concurrency > 1:
            self.engine = ThreadEngine(callback, setup.concurrency)

    def run(self, task: Task) -> Result:
        """Runs one task; returns a :class:`TaskDone` or :class:`TaskFailed`."""
        if self.cpu is not None:
            self.cpu.task_begins()
        if self.setup.kind == SAMPLE:
            engine = self.engine
            if engine is not None:
                return self._run_concurrent(task, engine)
            return self._run_samples(task)
        return self._run_batch(task)

    # -- sample mode, samples in flight together -------------------------------------------------

    def _run_concurrent(self, task: Task, engine: Union[AsyncEngine, ThreadEngine]) -> Result:
        """Up to ``concurrency`` samples of the task in flight (see :mod:`extsrc.engine.concurrent`);
        each is written as soon as it is back; the outcome is that of a sequential run."""
        jobs, deliver, conclude = self._plan_concurrent(task)
        try:
            outcome = engine.run(jobs, deliver, self.sample_limit_s)
        except BaseException as exc:  # a bug in the engine: fail the task rather than the worker
            return self._failed(task, task.start, None, exc, from_callback=False)
        return conclude(outcome)

    @property
    def overlaps(self) -> bool:
        """Whether this source's tasks may run together in the worker (:meth:`run_overlapping`):
        an ``async def`` callback in sample mode, whose samples share the worker's event loop."""
        return self.setup.kind == SAMPLE and isinstance(self.engine, AsyncEngine)

    async def run_overlapping(self, task: Task) -> Result:
        """:meth:`run` as a coroutine on the worker's event loop, for a source that
        :attr:`overlaps`: the worker starts the samples of its next task while this one's are
        in flight, all of them within the one ``concurrency`` of the worker. The task's result
        is the same as :meth:`run`'s; only the timing differs."""
        if self.cpu is not None:
            self.cpu.task_begins()
        engine = self.engine
        jobs, deliver, conclude = self._plan_concurrent(task)
        try:
            assert isinstance(engine, AsyncEngine), "only a source whose tasks overlap runs them so"
            outcome = await engine.run_shared(jobs, deliver, self.sample_limit_s)
        except Exception as exc:  # a bug in the engine: fail the task rather than the worker
            return self._failed(task, task.start, None, exc, from_callback=False)
        return conclude(outcome)

    def _plan_concurrent(self, task: Task) -> Tuple[Iterator[Job], Deliver, Callable[[Outcome], Result]]:
        """``(jobs, deliver, conclude)`` of a task run by the engine: its samples as jobs, where
        each one goes when it is back, and the task's result from the engine's outcome."""
        base = task.iteration * self.setup.batch_size
        records, stopped = self._records(task.epoch_idx, base + task.start, base + task.stop)
        seed, iteration, epoch_idx = self.seed, task.iteration, task.epoch_idx
        make = tuple.__new__

        def describe(pos: int) -> str:
            return f"sample {self._info(task, pos)}"

        write = self.writer.begin(task.slot_id, task.batch_seq, task.start, task.stop,
                                  task.region_bytes, task.regions, describe)
        columns = self._columns_of_samples

        def deliver(position: int, value: object) -> None:
            write.add(columns([value], position, describe), position, 1)

        info_class = self.info_class
        jobs = ((position, make(info_class, (base + position, position, iteration, epoch_idx,
                                             record, seed)))
                for position, record in zip(range(task.start, task.stop), records))
        began = self.clock()
        return jobs, deliver, lambda outcome: self._conclude(task, write, records, stopped, began,
                                                             outcome)

    def _conclude(self, task: Task, write: TaskSink, records: Sequence[int], stopped: bool,
                  began: int, outcome: Outcome) -> Result:
        """The result of a task the engine ran, from its outcome."""
        ended = self.clock()
        # Tasks that overlap (run_overlapping) count the worker's busy time once: each counts
        # only its time after the end of the last one counted.
        busy = max(0, ended - max(began, self.busy_until))
        self.busy_until = max(self.busy_until, ended)
        count = len(records)
        event = outcome.event
        if event is not None:
            error, position = event.error, event.position
            if isinstance(error, Hung):
                return self._hung(task, position, error)
            if not isinstance(error, StopIteration):
                if event.in_callback:
                    return self._failed(task, position, self._info(task, position), error)
                return self._write_failed(task, position, error)
            if self.setup.order is not None:
                stop_error = self._stopped_before_the_order(task, position)
                stop_error.__cause__ = error
                return self._failed(task, position, self._info(task, position), stop_error,
                                    from_callback=False)
            count, stopped = position - task.start, True
        timed = tuple((1, ns) for ns in outcome.in_flight_ns) if self.setup.timed else ()
        try:
            return self._done(task, write, count, stopped, busy, timed, sum(outcome.in_flight_ns))
        except Exception as exc:
            return self._write_failed(task, task.start, exc)

    def _hung(self, task: Task, position: int, hung: Hung) -> TaskFailed:
        info = self._info(task, position)
        message = (
            f"sample {info} of source {self.setup.name} was in flight for {hung.seconds:.1f} s, "
            f"longer than {SAMPLE_TIMEOUT_SHARE} x timeout={self.setup.timeout} s (a request that "
            f"hangs?); worker "
            f"{self.worker} ran up to concurrency={self.setup.concurrency} samples at once. "
            "The workers were shut down."
        )
        error = SourceTimeoutError(message, timeout=self.setup.timeout)
        return TaskFailed(task.source_id, task.ticket, self.worker, position, info,
                          pickle.dumps(error), type(error).__qualname__, message,
                          f"Where the call was waiting:\n{hung.stack}", True)

    # -- sample mode ---------------------------------------------------------------------------

    def _run_samples(self, task: Task) -> Result:
        callback = self.sample_call
        base = task.iteration * self.setup.batch_size
        first, last = base + task.start, base + task.stop
        records, stopped = self._records(task.epoch_idx, first, last)
        seed = self.seed
        make = tuple.__new__
        info_class = self.info_class

        def describe(pos: int) -> str:
            return f"sample {self._info(task, pos)}"

        write = self.writer.begin(task.slot_id, task.batch_seq, task.start, task.stop,
                                  task.region_bytes, task.regions, describe)
        buffers = self.buffers
        if buffers is None:
            produce = callback
        else:
            buffers.write = write

            def produce(info: SampleInfo) -> Any:  # the callback's sample
                buffers.position = info.idx_in_batch
                return callback(info, buffers)
        iteration, epoch_idx = task.iteration, task.epoch_idx
        # Samples wait here until STREAM_BYTES of them do, then go to shared memory: large
        # ones one by one (the callback's memory is then reused for the next sample instead
        # of being faulted in anew); small ones in one copy per task, or, once the layout is
        # known, each into its row as it comes (below).
        waiting: List[Any] = []  # the callback's samples, checked by the writer
        waiting_bytes = 0
        chunk_start = task.start
        position = task.start
        positions = zip(range(task.start, task.stop), records)
        # The callback is timed per group of samples written together (clock reads per group,
        # not per sample: the statistics cost nothing measurable).
        clock = self.clock
        timed: List[Tuple[int, int]] = []
        began = group_began = clock()
        group_first = chunk_start  # the group's first sample
        writing = False  # whether an exception comes from writing samples, not from the callback
        try:
            for position, record in positions:
                value = produce(make(info_class, (base + position, position, iteration, epoch_idx,
                                                  record, seed)))
                waiting.append(value)
                waiting_bytes += _nbytes(value)
                if waiting_bytes >= STREAM_BYTES:
                    timed.append((len(waiting), clock() - group_began))
                    writing = True
                    self._flush(write, waiting, chunk_start)
                    writing = False
                    chunk_start += len(waiting)
                    # The sample is written: let go of it before the next call, so that
                    # the callback's next array reuses its memory instead of faulting in
                    # new pages (a large sample held across the call costs ~40% here).
                    waiting, waiting_bytes, value = [], 0, None
                    group_began, group_first = clock(), chunk_start
                elif (len(waiting) == 1 and chunk_start == task.start
                      and waiting_bytes * (task.stop - task.start) * SMALL_TASK_FACTOR < STREAM_BYTES):
                    break  # samples like the first one: the rest go without counting bytes
            rows = (write.direct_rows(waiting[0], chunk_start)
                    if len(waiting) == 1 and buffers is None and self.num_outputs is None
                    and not self.learns_outputs else None)
            if rows is not None:
                # Small samples that fit the region go into it as they come, each a row: the
                # callback's next array then reuses the memory of the last (malloc's per-thread
                # cache), where gathering a task's samples first cost ~6% on 1 KiB samples.
                # Any other sample, and those after it, go through write.add() as before.
                ndarray, shape, dtype, start = np.ndarray, rows.shape[1:], rows.dtype, task.start
                rows[chunk_start - start] = waiting[0]
                waiting, chunk_start = [], chunk_start + 1
                for position, record in positions:
                    value = produce(make(info_class, (base + position, position, iteration, epoch_idx,
                                                      record, seed)))
                    # The test extsrc.shm.writer._write_dense makes of each sample, written
                    # out here rather than called: it runs once per sample.
                    if (value.__class__ is ndarray and value.shape == shape
                            and (value.dtype is dtype or value.dtype == dtype)):
                        rows[position - start] = value
                        chunk_start = position + 1
                    else:
                        waiting = [value]
                        break
                value = None
            append = waiting.append
            for position, record in positions:
                append(produce(make(info_class, (base + position, position, iteration, epoch_idx,
                                                 record, seed))))
        except StopIteration as exc:
            if self.setup.order is not None:
                error = self._stopped_before_the_order(task, position)
                error.__cause__ = exc
                return self._failed(task, position, self._info(task, position), error,
                                    from_callback=False)
            stopped = True
        except SampleError as exc:
            return self._failed(task, getattr(exc, "position", position), None, exc, from_callback=False)
        except SharedMemoryError as exc:
            return self._failed(task, position, None, exc, from_callback=False)
        except BaseException as exc:
            if writing:
                return self._write_failed(task, chunk_start, exc)
            return self._failed(task, position, self._info(task, position), exc)
        if chunk_start > group_first or waiting:
            timed.append((chunk_start - group_first + len(waiting), clock() - group_began))
        try:
            self._flush(write, waiting, chunk_start)
            count = chunk_start - task.start + len(waiting)
            return self._done(task, write, count, stopped, clock() - began, tuple(timed))
        except Exception as exc:
            return self._write_failed(task, chunk_start, exc)

    def _stopped_before_the_order(self, task: Task, position: int) -> EpochLengthError:
        """The error for a callback that raised ``StopIteration`` at ``position`` under an order:
        the order sets the epoch's length, so the two must not silently disagree."""
        order, batch_size = self.setup.order, self.setup.batch_size
        assert order is not None, "called under an order only"
        length = len(order)
        batches = length // batch_size if self.setup.last_batch == "drop" else -(-length // batch_size)
        info = self._info(task, position)
        return EpochLengthError(
            f"source {self.setup.name}: the callback raised StopIteration at sample {info!r} "
            f"(record {info.record}), but its order {order!r} makes an epoch of {length} samples "
            f"(len(source) == {batches} batches of {batch_size}). With order=, the order decides "
            f"where an epoch ends: give it the number of records the callback can load "
            f"(extsrc.Order({info.idx_in_epoch}, ...) if the data ends there), or do not raise "
            "StopIteration for a record of the order."
        )

    def _flush(self, write: TaskSink, waiting: List[Any], chunk_start: int) -> None:
        if waiting:
            write.add(self._columns_of_samples(waiting, chunk_start, write.describe), chunk_start,
                      len(waiting))

    def _records(self, epoch_idx: int, first: int, last: int) -> Tuple[Sequence[int], bool]:
        """The records of positions ``first..last-1``, and whether the epoch ends before ``last``.

        Without an order a record is its position. With one, positions past the
        shard's epoch are the end of it, or, with ``last_batch="pad"``, records
        from the start of the epoch's order again.
        """
        if self.records is None or self.setup.order is None:  # both or neither
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

    def _learn_outputs(self, first: object, where: str) -> int:
        """num_outputs="auto": the number of outputs, from this worker's first sample or batch."""
        if not isinstance(first, (tuple, list)) or not first:
            raise SampleError(
                f"{where}: expected a non-empty tuple of outputs (num_outputs={AUTO_OUTPUTS!r}), got "
                f"{type(first).__name__}"
            )
        self.num_outputs = len(first)
        return self.num_outputs

    def _declared(self) -> str:
        if self.learns_outputs:
            return f"num_outputs={AUTO_OUTPUTS!r}, as many as this worker's first sample had"
        return f"num_outputs={self.num_outputs}"

    def _columns_of_samples(self, produced: Sequence[Any], start: int, describe: Describe
                            ) -> List[Sequence[Any]]:
        num_outputs = self.num_outputs
        if num_outputs is None:
            if not self.learns_outputs:
                return [produced]
            if not produced:
                return []
            first = next((k for k, sample in enumerate(produced) if sample is not SKIPPED), None)
            if first is None:
                return []  # every sample skipped, before the outputs are known: nothing to write
            try:
                num_outputs = self._learn_outputs(produced[first], describe(start + first))
            except SampleError as exc:
                raise at(start + first, exc) from None  # the same exception, marked
        skipped = False
        for k, sample in enumerate(produced):
            if sample is SKIPPED:
                skipped = True
                continue
            if not isinstance(sample, (tuple, list)) or len(sample) != num_outputs:
                got = (
                    f"a {type(sample).__name__} of {len(sample)} outputs"
                    if isinstance(sample, (tuple, list))
                    else f"one {type(sample).__name__}"
                )
                raise at(start + k, SampleError(
                    f"{describe(start + k)}: expected a tuple of {num_outputs} outputs "
                    f"({self._declared()}), got {got}"
                ))
        if not produced:
            return [[] for _ in range(num_outputs)]
        if skipped:
            return [[SKIPPED if sample is SKIPPED else sample[j] for sample in produced]
                    for j in range(num_outputs)]
        return [list(column) for column in zip(*produced)]

    # -- batch mode ----------------------------------------------------------------------------

    def _run_batch(self, task: Task) -> Result:
        setup = self.setup
        info = BatchInfo(task.iteration, task.epoch_idx)
        began = self.clock()
        try:
            if setup.kind == BATCH_CALLABLE:
                batch = self.call_batch(info if self.hooks.batch_info else task.iteration)
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
        except Exception as exc:
            replaced = self._replace_batch(task, info, exc)
            if isinstance(replaced, TaskFailed):
                return replaced
            batch = replaced
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

    def _replace_batch(self, task: Task, info: BatchInfo, exc: Exception) -> object:
        """The batch ``on_error(info, exc)`` gives in place of the callback's (a callable
        on_error), or the task's failure."""
        on_error = self.hooks.on_error
        if not callable(on_error) or self.setup.kind != BATCH_CALLABLE:
            return self._failed(task, 0, info, exc)
        try:
            batch = on_error(info, exc)
        except BaseException as error:
            return self._failed(task, 0, info, error)
        self.faults.append(fault_of(info, exc, True))
        return batch

    # -- what the worker does with the written samples -----------------------------------------

    def _done(self, task: Task, write: TaskSink, count: int, stopped: bool, busy_ns: int,
              timed: Tuple[Tuple[int, int], ...], waited_ns: Optional[int] = None) -> Result:
        """The answer to ``task`` once its ``count`` samples went to ``write`` (what
        ``self.writer.begin`` gave): the writer's (:meth:`WriterSink.answer`). ``waited_ns``:
        the samples' time in flight, when they were in flight together (else ``busy_ns``).
        Raises what the writer raises."""
        spilled, overflow = write.finish(task.give_back)
        cpu = self.cpu.task_ran(busy_ns) if self.cpu is not None else (-1, -1)
        end = task.start + count  # samples written past a StopIteration are not the batch's
        if end < task.stop:  # else every sample written is the batch's: none to look at
            spilled = tuple(tuple(s for s in out if s.position < end) for out in spilled)
        done = TaskDone(task.source_id, task.ticket, self.worker, count, stopped, spilled, overflow,
                        busy_ns, timed, busy_ns if waited_ns is None else waited_ns,
                        *cpu, notes=self._notes(),
                        faults=faults_of_task(self.faults, task.epoch_idx, task.iteration,
                                              task.start, task.stop))
        return self.writer.answer(task, write, done)

    def _notes(self) -> Tuple[str, ...]:
        """Warnings for the user after a task: once, a callback that reads ``idx_in_epoch`` and
        not ``record`` under an order that moves records."""
        reads = self.reads
        if reads is None or not reads[0] and not reads[1]:
            return ()
        self.info_class, self.reads = SampleInfo, None  # decided: no more noting
        if reads[1]:
            return ()
        return (
            f"source {self.setup.name}: the callback reads SampleInfo.idx_in_epoch (the position "
            f"in the epoch) and never SampleInfo.record, under order={self.setup.order!r}, which "
            "puts another record at each position (shuffled or sharded): it loads the positions "
            "in order and the order is lost. Load info.record instead (the DALI tutorials' "
            "info.idx_in_epoch is the position, not the record).",
        )

    def _iterator_for(self, epoch_idx: int) -> Iterator[object]:
        if self.iterator_epoch != epoch_idx:
            source = self.callback
            if self.setup.kind == BATCH_GENERATOR:
                self.iterator = source()
            else:
                # Every epoch calls iter() again: an iterable whose __iter__ resets its state and
                # returns itself starts a new pass (DALI does the same after each reset()).
                if self.hooks.begin_epoch is not None:
                    self.hooks.begin_epoch(source, epoch_idx)
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

    def _columns_of_batch(self, batch: Any, info: BatchInfo) -> List[Sequence[Any]]:  # the callback's batch
        num_outputs = self.num_outputs
        if num_outputs is None and self.learns_outputs:
            num_outputs = self._learn_outputs(batch, f"batch {info}")
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
                f"({self._declared()}), got {got}"
            )
        lengths = []
        for j, column in enumerate(columns):
            if isinstance(column, np.ndarray) and column.ndim >= 1 and column.dtype.kind != "O":
                columns[j] = _column_of_samples(column)
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

    def _failed(self, task: Task, position: int, where: Union[SampleInfo, BatchInfo, None], exc: BaseException,
                from_callback: bool = True) -> TaskFailed:
        faults_of_task(self.faults, task.epoch_idx, task.iteration, task.start, task.stop)  # lost with it
        return failure(task, self.worker, position, where, exc, from_callback)

    def _write_failed(self, task: Task, chunk_start: int, exc: BaseException) -> TaskFailed:
        """``exc`` came from checking or writing the samples from ``chunk_start`` on. extsrc's
        own errors name their sample; any other is tied to the first sample of the chunk."""
        if isinstance(exc, ExtsrcError):
            return self._failed(task, getattr(exc, "position", chunk_start), None, exc, from_callback=False)
        return self._failed(task, chunk_start, self._info(task, chunk_start), exc, from_callback=False)

    def close(self) -> None:
        if isinstance(self.engine, ThreadEngine):
            self.engine.close()
        if self.cpu is not None:
            self.cpu.close()
        self.writer.close()


def failure(task: Task, worker: int, position: int, where: Union[SampleInfo, BatchInfo, None], exc: BaseException,
            from_callback: bool = True) -> TaskFailed:
    """The :class:`TaskFailed` of ``task`` for ``exc``, raised at sample ``position`` (``where``:
    its ``SampleInfo``/``BatchInfo``, if tied to one) by the callback or, if not
    ``from_callback``, by checking or writing its output."""
    tb = exc.__traceback__
    if from_callback and tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # start at the callback, not at the worker's loop
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    payload = dumps_exception(exc)
    return TaskFailed(
        task.source_id, task.ticket, worker, position, where, payload,
        type(exc).__qualname__, str(exc), text, from_callback,
    )
