"""The worker process: load the sources, then run tasks until told to stop.

A worker owns nothing but its socket to the pool and the descriptors of the
shared-memory segments it writes. It exits when the pool sends ``STOP``, when
the socket closes (the pool closed or the parent died), or when its parent
process goes away while a callback is still running (checked twice a second).
"""

from __future__ import annotations

import inspect
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from extsrc.errors import SampleError
from extsrc.messages import STOP, Task, TaskDone, TaskFailed, WorkerSetupFailed
from extsrc.pickling import Pickler
from extsrc.sample_info import BatchInfo, SampleInfo
from extsrc.shm import PassedFd, Segment
from extsrc.writer import TaskWriter

SAMPLE, BATCH_CALLABLE, BATCH_ITERABLE, BATCH_GENERATOR = "sample", "callable", "iterable", "generator"


@dataclass
class SourceSpec:
    """What one worker needs to run one source (built by the source, sent at start)."""

    source_id: int
    name: str
    kind: str
    callback: Any  # the callable/iterable itself (fork) or its pickled bytes (spawn)
    pickled: bool
    batch_size: int
    num_outputs: Optional[int]
    batch_info: bool
    dtypes: Tuple[Optional[str], ...]
    ndims: Tuple[Optional[int], ...]
    shm_kind: str
    slot_fds: List[PassedFd]
    overflow_fds: List[PassedFd]


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


class SourceRunner:
    """Runs the tasks of one source inside a worker."""

    def __init__(self, spec: SourceSpec, pickler: Optional[Pickler], worker: int):
        self.spec = spec
        self.worker = worker
        self.callback = pickler.loads(spec.callback) if spec.pickled else spec.callback
        slots = [Segment(p.fd, spec.shm_kind, f"source {spec.name!r}") for p in spec.slot_fds]
        overflow = [
            Segment(p.fd, spec.shm_kind, f"source {spec.name!r}, worker {worker}")
            for p in spec.overflow_fds
        ]
        self.writer = TaskWriter(
            slots,
            overflow,
            spec.num_outputs,
            tuple(None if d is None else np.dtype(d) for d in spec.dtypes),
            spec.ndims,
            spec.batch_size,
        )
        self.iterator: Any = None
        self.iterator_epoch = -1

    def run(self, task: Task):
        """Runs one task; returns a :class:`TaskDone` or :class:`TaskFailed`."""
        if self.spec.kind == SAMPLE:
            return self._run_samples(task)
        return self._run_batch(task)

    # -- sample mode ------------------------------------------------------------

    def _run_samples(self, task: Task):
        callback = self.callback
        base = task.iteration * self.spec.batch_size
        make = tuple.__new__
        produced: List[Any] = []
        append = produced.append
        stopped = False
        position = task.start
        try:
            for position in range(task.start, task.stop):
                append(callback(make(SampleInfo, (base + position, position, task.iteration, task.epoch_idx))))
        except StopIteration:
            stopped = True
        except Exception as exc:
            info = SampleInfo(base + position, position, task.iteration, task.epoch_idx)
            return self._failed(task, position, info, exc)
        count = len(produced)

        def describe(pos: int) -> str:
            return f"sample {SampleInfo(base + pos, pos, task.iteration, task.epoch_idx)}"

        try:
            columns = self._columns_of_samples(produced, task.start, describe)
            placements, overflow_size = self.writer.write(task, columns, count, describe)
        except Exception as exc:
            position = _failed_position(exc, task.start)
            return self._failed(task, position, None, exc, from_callback=False)
        return TaskDone(task.source_id, task.ticket, self.worker, count, stopped, placements, overflow_size)

    def _columns_of_samples(self, produced, start, describe) -> List[Sequence[Any]]:
        num_outputs = self.spec.num_outputs
        if num_outputs is None:
            return [produced]
        for k, sample in enumerate(produced):
            if not isinstance(sample, (tuple, list)) or len(sample) != num_outputs:
                got = (
                    f"a {type(sample).__name__} of {len(sample)} outputs"
                    if isinstance(sample, (tuple, list))
                    else f"one {type(sample).__name__}"
                )
                error = SampleError(
                    f"{describe(start + k)}: expected a tuple of {num_outputs} outputs "
                    f"(num_outputs={num_outputs}), got {got}"
                )
                error.position = start + k
                raise error
        return [list(column) for column in zip(*produced)] if produced else [[] for _ in range(num_outputs)]

    # -- batch mode -------------------------------------------------------------

    def _run_batch(self, task: Task):
        spec = self.spec
        info = BatchInfo(task.iteration, task.epoch_idx)
        try:
            if spec.kind == BATCH_CALLABLE:
                batch = self.callback(info if spec.batch_info else task.iteration)
            else:
                batch = next(self._iterator_for(task.epoch_idx))
        except StopIteration:
            return TaskDone(task.source_id, task.ticket, self.worker, 0, True, (), 0)
        except Exception as exc:
            return self._failed(task, 0, info, exc)

        def describe(pos: int) -> str:
            return f"sample {pos} of batch {info}"  # batch mode: no SampleInfo

        try:
            columns = self._columns_of_batch(batch, info)
            count = len(columns[0])
            placements, overflow_size = self.writer.write(task, columns, count, describe)
        except Exception as exc:
            return self._failed(task, _failed_position(exc, 0), info, exc, from_callback=False)
        return TaskDone(task.source_id, task.ticket, self.worker, count, False, placements, overflow_size)

    def _iterator_for(self, epoch_idx: int):
        if self.iterator_epoch != epoch_idx:
            source = self.callback
            self.iterator = source() if self.spec.kind == BATCH_GENERATOR else iter(source)
            self.iterator_epoch = epoch_idx
        return self.iterator

    def _columns_of_batch(self, batch, info: BatchInfo) -> List[Sequence[Any]]:
        num_outputs = self.spec.num_outputs
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
            raise SampleError(
                f"batch {info}: the outputs have different numbers of samples: {lengths}"
            )
        if lengths[0] > self.spec.batch_size:
            raise SampleError(
                f"batch {info}: the source returned {lengths[0]} samples, more than "
                f"batch_size={self.spec.batch_size}"
            )
        if lengths[0] == 0:
            raise SampleError(
                f"batch {info}: the source returned an empty batch; raise StopIteration to end "
                "the epoch instead"
            )
        return columns

    # -- failures ---------------------------------------------------------------

    def _failed(self, task, position, where, exc: BaseException, from_callback: bool = True):
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
            task.source_id, task.ticket, self.worker, position, where, payload,
            type(exc).__qualname__, str(exc), text, from_callback,
        )


def _failed_position(exc: BaseException, default: int) -> int:
    return getattr(exc, "position", default)


def _exit_when_orphaned(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


def worker_main(
    index: int,
    conn,
    specs: List[SourceSpec],
    pickler: Optional[Pickler],
    inherited_fds: Sequence[int],
) -> None:
    """Entry point of a worker process (the ``target`` of its ``Process``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    for fd in inherited_fds:  # fork only: the pool's ends of other workers' sockets
        try:
            os.close(fd)
        except OSError:
            pass
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    send, recv, dumps, loads = conn.send_bytes, conn.recv_bytes, pickle.dumps, pickle.loads
    try:
        runners: Dict[int, SourceRunner] = {s.source_id: SourceRunner(s, pickler, index) for s in specs}
    except Exception as exc:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            send(dumps(WorkerSetupFailed(index, f"{type(exc).__name__}: {exc}", text)))
        except OSError:
            pass
        return
    while True:
        try:
            task = loads(recv())
        except (EOFError, OSError):
            return
        if task is STOP:
            return
        result = runners[task.source_id].run(task)
        try:
            send(dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            return
