"""A worker of the Ray backend: a Ray actor that runs the callbacks and returns the samples.

:class:`SourceActor` is what :class:`~extsrc.ray.RayPool` makes remote. It
loads the sources once, like a worker process (they come pickled with the
pool's pickler), and runs tasks with the engine's
:class:`~extsrc.engine.runner.SourceRunner`: the same ``SampleInfo`` /
``BatchInfo`` / ``Order`` records, the same checks and the same errors. Only
the last step differs: instead of writing the samples into shared memory it
cannot reach (it may be on another host), it returns them, checked, as a
:class:`~extsrc.ray.protocol.Produced`, through Ray's object store.

Ray runs an actor's calls one at a time in the order they were sent, which
iterable sources (whose state lives in one worker) rely on.
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from extsrc.engine.protocol import SetupFailed, SourceSetup, Task, TaskFailed
from extsrc.engine.runner import SAMPLE, SourceRunner
from extsrc.ray.protocol import ActorReady, Produced

# Samples up to this size travel stacked, as one array per output: Ray serialises every array
# with some fixed cost (tens of microseconds), which dominates for small samples. Larger ones
# travel as they are: stacking them would copy the whole batch once more in the actor, for a
# per-array cost that is small next to their size.
STACK_MAX_SAMPLE_BYTES = 64 << 10


class PackedWrite:
    """The samples of one task, checked and kept to be returned (what a worker process would
    write into shared memory). Same methods as :class:`extsrc.shm.writer.TaskWrite` that the
    runner calls: ``add`` a chunk of samples, ``alloc`` room for an ``in_place`` callback (here a
    fresh array, returned with the others), ``describe`` a position."""

    def __init__(self, checker: Any, num_outputs: int, describe: Callable[[int], str]):
        self.checker = checker
        self.describe = describe
        self.chunks: List[List[Any]] = [[] for _ in range(num_outputs)]  # per output, packed chunks

    def alloc(self, output: int, position: int, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self.checker.check(np.empty((0,) * len(shape), dtype), output, position, self.describe(position),
                           None, "")
        return np.empty(shape, dtype)

    def add(self, columns: List[Sequence[Any]], position: int, count: int) -> None:
        if count:
            for j, column in enumerate(columns):
                self.chunks[j].append(pack(self.checker, j, column, position, count, self.describe))

    def columns(self) -> Tuple[Any, ...]:
        """Per output: one packed chunk as it is, several as one list of samples."""
        joined = []
        for chunks in self.chunks:
            if len(chunks) == 1:
                joined.append(chunks[0])
            else:
                joined.append([sample for chunk in chunks for sample in chunk])
        return tuple(joined)


class PackingWriter:
    """In place of the engine's :class:`~extsrc.shm.writer.TaskWriter`: a
    :class:`PackedWrite` per task, whatever its slot (the pool writes the slot)."""

    def __init__(self, checker: Any, num_outputs: int):
        self.checker = checker
        self.num_outputs = num_outputs

    def begin(self, slot_id: int, batch_seq: int, start: int, stop: int, region_bytes: int,
              regions: Any, describe: Callable[[int], str]) -> PackedWrite:
        return PackedWrite(self.checker, self.num_outputs, describe)


class ActorRunner(SourceRunner):
    """The engine's runner, answering with the checked samples rather than writing them."""

    def __init__(self, setup: SourceSetup, callback: Any, worker: int):
        super().__init__(setup, callback, worker)
        self.writer = PackingWriter(self.writer.checker, setup.num_outputs or 1)  # None: one output

    def _done(self, task: Task, write: Any, count: int, stopped: bool, busy_ns: int,
              timed: Tuple[Tuple[int, int], ...]) -> Produced:
        start = task.start if self.setup.kind == SAMPLE else 0
        return Produced(task.source_id, task.ticket, start, count, stopped, write.columns(), busy_ns,
                        timed)


def pack(checker: Any, output: int, column: Sequence[Any], start: int, count: int,
         describe: Callable[[int], str]) -> Any:
    """Samples ``column[:count]`` of ``output``, checked as the writer would check them
    (:class:`~extsrc.engine.samples.SampleChecker`), as one array or a list of arrays.

    Raises :class:`~extsrc.errors.SampleError` naming the first bad sample.
    """
    if count == 0:
        return []
    first_where = describe(start)
    first = checker.check(column[0], output, start, first_where, None, "")
    if isinstance(column, np.ndarray) and column.ndim == first.ndim + 1:
        return np.ascontiguousarray(column[:count])  # batch mode: every row is like the first
    shape, dtype = first.shape, first.dtype
    samples = list(column[:count])
    samples[0] = first
    same = all(s.__class__ is np.ndarray and s.shape == shape and s.dtype == dtype
               for s in samples[1:])
    if not same:
        for k in range(1, count):
            samples[k] = checker.check(samples[k], output, start + k, describe(start + k), first,
                                       first_where)
        same = all(s.shape == shape and s.dtype == dtype for s in samples)
    if same and first.nbytes <= STACK_MAX_SAMPLE_BYTES:
        return np.stack(samples)
    return samples


class SourceActor:
    """One worker of a :class:`~extsrc.ray.RayPool`, as a Ray actor (see the module docstring).

    ``sources`` are the pool's :class:`~extsrc.engine.protocol.SourceSetup` s,
    pickled with ``pickler``. A failure to load them is reported by every
    call (:class:`~extsrc.engine.protocol.SetupFailed`), not raised, so that
    the pool can say what went wrong.
    """

    def __init__(self, index: int, sources: Tuple[SourceSetup, ...], pickler: Any):
        self.index = index
        self.runners: Dict[int, ActorRunner] = {}
        self.setup_failed: Optional[SetupFailed] = None
        try:
            for source in sources:
                callback = pickler.loads(source.callback) if source.pickled else source.callback
                self.runners[source.source_id] = ActorRunner(source, callback, index)
        except BaseException as exc:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self.setup_failed = SetupFailed(index, f"{type(exc).__name__}: {exc}", text)

    def ready(self) -> Union[ActorReady, SetupFailed]:
        """Where this actor runs, once it has loaded the sources."""
        if self.setup_failed is not None:
            return self.setup_failed
        import ray

        context = ray.get_runtime_context()
        return ActorReady(self.index, context.get_actor_id(), context.get_node_id(),
                          ray.util.get_node_ip_address(), socket.gethostname(), os.getpid())

    def run(self, tasks: Tuple[Task, ...]) -> Union[List[Union[Produced, TaskFailed]], SetupFailed]:
        """Runs ``tasks`` in order (see :meth:`extsrc.engine.runner.SourceRunner.run`); their
        answers, in the same order."""
        if self.setup_failed is not None:
            return self.setup_failed
        return [self.runners[task.source_id].run(task) for task in tasks]

    def ping(self) -> None:
        """Answers once the actor runs; after ``ray.kill``, the error says it is dead."""
