"""Unit tests: a producer's batches across runs, against a pool that only records."""

from typing import List, Optional

import numpy as np

from extsrc.engine.kinds import SAMPLE
from extsrc.engine.producer import Producer
from extsrc.engine.spec import SourceSpec
from extsrc.shm.slots import SlotState


class RecordingPool:
    """The pool as a producer sees it: tasks are recorded, never run. ``queued`` is what
    ``discard_queued`` finds still waiting for a worker (the pool puts a lost worker's tasks
    back there, for the worker that takes its place)."""

    num_workers = 1
    max_outstanding = 2
    broken = False

    class workers_backend:
        local_processes = False

    def __init__(self) -> None:
        self.submitted: List[object] = []
        self.queued: List[object] = []
        self._tickets = 0

    def attach(self, client: object) -> int:
        return 0

    def new_ticket(self) -> int:
        self._tickets += 1
        return self._tickets

    def submit(self, task: object, worker: Optional[int] = None) -> None:
        self.submitted.append(task)

    def discard_queued(self, source_id: int) -> List[object]:
        queued, self.queued = self.queued, []
        return queued

    def wake(self) -> None:
        pass

    def tasks_short(self, source_id: int) -> bool:
        return False

    def task_seconds(self, source_id: int) -> float:
        return 0.0

    def has_idle_worker(self) -> bool:
        return False

    def add_slot(self, source_id: int, slot_id: int, region_fd: int, overflow_fds: List[int]) -> None:
        pass

    def drop_slot(self, source_id: int, slot_id: int) -> None:
        pass


def test_a_left_batch_whose_task_comes_back_to_the_queue_gives_its_slot_back():
    # A batch of an epoch the consumer left drains while its task runs. Should its worker be
    # lost, the task goes back to the queue; a new epoch started before a worker took it
    # discards it, and nothing will come for the batch: its slot must be free again, not
    # draining for good (the source would make fewer batches ahead from then on).
    pool = RecordingPool()
    producer = Producer(lambda info: np.zeros(4), SAMPLE, SourceSpec(4, prefetch=2), pool, None)
    try:
        producer.request(0)
        producer.service()
        (left,) = pool.submitted  # the layout is not known yet: one batch per worker
        slot = producer.in_flight[left.ticket].slot
        producer.request(1)  # the consumer leaves epoch 0 while the task runs
        producer.service()
        assert slot.state is SlotState.DRAINING
        pool.queued = [left]  # its worker was lost: the task is queued again
        producer.request(2)
        producer.service()
        assert slot.state is not SlotState.DRAINING  # free, or already epoch 2's
        assert producer.slots.draining == 1  # epoch 1's batch, whose task runs
    finally:
        producer.close(tell_workers=False)
