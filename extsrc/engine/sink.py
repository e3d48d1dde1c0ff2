"""Where a worker's samples go: the writer seam between the runner and a backend.

The runner (:class:`~extsrc.engine.runner.SourceRunner`) calls the source's
callback and hands what it made to a :class:`WriterSink`; it never knows where
the samples end up. A worker process uses the engine's own sink,
:class:`extsrc.shm.writer.TaskWriter`, which writes into the slot's shared
memory and answers with the engine's ``TaskDone``. A backend whose workers
cannot always reach the slot (a Ray actor on another node) passes a sink of
its own to the runner, which keeps the samples and answers with its own
message, without subclassing the runner.

Caller, thread and owner: the runner's thread (the worker's main thread, or a
Ray actor's runner thread) calls ``begin``, the task sink's methods and
``answer``, one task at a time; ``add_slot``/``drop_slot`` come from the
thread that reads the pool's messages (the same one in a worker process), in
the order sent, a slot before the tasks that use it. The sink owns the
descriptors it is given and closes them in ``drop_slot``/``close``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

from extsrc.arrays import Array, DType
from extsrc.engine.protocol import Result, Task, TaskDone
from extsrc.shm.layout import Region, Spilled

Describe = Callable[[int], str]  # a sample's position in its batch -> "sample SampleInfo(...)"


class Checker(Protocol):
    """Checks a sample of an output (:class:`~extsrc.engine.samples.SampleChecker`)."""

    def check(self, value: object, output: int, position: int, describe: Describe,
              first: Optional[Array], first_at: int) -> Array: ...


class TaskSink(Protocol):
    """One task's samples, handed over a chunk at a time as the callback makes them."""

    describe: Describe

    def add(self, columns: List[Sequence[Any]], position: int, count: int) -> None:
        """Samples ``position .. position + count - 1``, per output (``columns[j][k]``, as the
        callback made them: checked here)."""

    def direct_rows(self, sample: object, position: int) -> Optional[Array]:
        """Rows the runner may write small samples like ``sample`` into itself, or None."""

    def alloc(self, output: int, position: int, shape: Tuple[int, ...],
              dtype: DType) -> Array:
        """Room for sample ``position`` of ``output``, for an ``in_place=True`` callback."""

    def finish(self, give_back: bool = False) -> Tuple[Tuple[Tuple[Spilled, ...], ...], int]:
        """Per output, the samples that went to overflow, and the overflow bytes in use; with
        ``give_back``, the overflow memory the batch does not need may be given back."""


class WriterSink(Protocol):
    """Where a runner's samples go (see the module docstring)."""

    checker: Checker

    def begin(self, slot_id: int, batch_seq: int, start: int, stop: int, region_bytes: int,
              regions: Tuple[Optional[Region], ...], describe: Describe) -> TaskSink:
        """Starts the samples ``start..stop-1`` of a batch bound for slot ``slot_id``."""

    def answer(self, task: Task, write: TaskSink, done: TaskDone) -> Result:
        """What the worker sends back for ``task``, whose samples went to ``write`` (what
        :meth:`begin` gave): ``done`` as the engine would answer, or the sink's own message."""

    def add_slot(self, slot_id: int, region_fd: int, overflow_fd: int, kind: str, worker: int) -> None:
        """A slot's descriptors, which the sink owns from now on."""

    def holds(self, slot_id: int) -> bool:
        """Whether the slot was added and not dropped since."""

    def drop_slot(self, slot_id: int) -> None:
        """The slot is no longer used (after every task for it answered)."""

    def close(self) -> None:
        """Closes every slot the sink holds."""
