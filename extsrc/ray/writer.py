"""Where the Ray backend writes a batch: into the slot, in the consumer's process.

A worker process writes its samples into the slot itself
(:class:`~extsrc.shm.writer.TaskWriter`); a Ray actor may run on another
host, so it returns them (:class:`~extsrc.ray.protocol.Produced`) and the
pool's I/O thread writes them here, with one ``TaskWriter`` per actor: the
region segment shared by all, and actor ``w``'s overflow segment of the slot,
exactly where a worker process ``w`` would have written. The source then gets
an ordinary :class:`~extsrc.engine.protocol.TaskDone`, and everything after
(assembly, leases, zero-copy batches) is the engine's. This is the one copy
the Ray backend adds: from Ray's reply or object store into the slot.

Threads: :meth:`ResultWriter.add_slot` and :meth:`ResultWriter.drop_slot` run
with the pool's lock held, in any thread; :meth:`ResultWriter.write` and
:meth:`ResultWriter.apply_drops` only in the pool's I/O thread, which may
write without the lock: nothing else touches the writers' mappings, and a
dropped slot is unmapped only by that thread, between writes.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Deque, List, Optional, Sequence, Union

from extsrc.engine import SourceSetup, Task, TaskDone, TaskFailed, WriterSink, failure, fork_lock, slot_writer
from extsrc.ray.protocol import Produced


class ResultWriter:
    """Writes what the actors returned for one source into its slots (see the module docstring)."""

    def __init__(self, setup: SourceSetup, num_workers: int):
        self.name = setup.name
        self.writers: List[WriterSink] = [slot_writer(setup) for _ in range(num_workers)]
        self.drops: Deque[int] = deque()  # slots to drop, by the I/O thread, in order

    def add_slot(self, slot_id: int, region_fd: int, overflow_fds: Sequence[int], kind: str) -> None:
        """A new slot: every actor's writer gets the region and that actor's overflow segment.

        The descriptors are duplicated (the slot keeps its own). Lock held.
        """
        with fork_lock:  # no child may be forked between a dup and its registration
            for worker, writer in enumerate(self.writers):
                writer.add_slot(slot_id, os.dup(region_fd), os.dup(overflow_fds[worker]), kind, worker)

    def drop_slot(self, slot_id: int) -> None:
        """The slot is retired: its mappings go at the I/O thread's next round. Lock held."""
        self.drops.append(slot_id)

    def apply_drops(self) -> None:
        """I/O thread: unmaps and closes the slots dropped since the last call."""
        while self.drops:
            slot_id = self.drops.popleft()
            for writer in self.writers:
                writer.drop_slot(slot_id)

    def write(self, worker: int, task: Task, produced: Produced) -> Optional[Union[TaskDone, TaskFailed]]:
        """I/O thread: writes ``produced`` (actor ``worker``'s answer to ``task``) into its slot.

        Returns the :class:`TaskDone` a worker process would have sent, a
        :class:`TaskFailed` when the memory cannot be had (``SharedMemoryError``
        with the sizes), or ``None`` when the slot is gone (its source was
        closed): nobody waits for it then.
        """
        writer = self.writers[worker]
        if not writer.holds(task.slot_id):
            return None

        def describe(position: int) -> str:
            return f"sample {position} of batch {task.iteration} of epoch {task.epoch_idx} of source {self.name}"

        try:
            write = writer.begin(task.slot_id, task.batch_seq, produced.start, task.stop,
                                 task.region_bytes, task.regions, describe)
            for position, count, columns in produced.pieces:
                write.add(list(columns), position, count)
            spilled, overflow = write.finish(task.give_back)
        except Exception as exc:
            return failure(task, worker, getattr(exc, "position", produced.start), None, exc,
                           from_callback=False)
        return TaskDone(task.source_id, task.ticket, worker, produced.count, produced.stopped,
                        spilled, overflow, produced.busy_ns, produced.timed, notes=produced.notes,
                        faults=produced.faults)

    def close(self) -> None:
        """I/O thread (or once it is gone): unmaps and closes every slot."""
        self.drops.clear()
        for writer in self.writers:
            writer.close()
