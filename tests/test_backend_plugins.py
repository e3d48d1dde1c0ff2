"""A backend registered by name, as a third party would add one (extsrc.engine.backend)."""

import dataclasses

import numpy as np
import pytest

import extsrc
from extsrc import InternalError, ParallelSource, WorkerPool
from extsrc.engine.backend import backend_names, register_backend, unregister_backend
from extsrc.engine.processes import ProcessBackend

from sources import sample_of


class RecordingBackend(ProcessBackend):
    """Worker processes that remember every task they were handed."""

    name = "recording-processes"
    assigned: list = []  # (source_id, ticket), of every pool of this backend

    def assign(self, worker, task):
        RecordingBackend.assigned.append((task.source_id, task.ticket))
        super().assign(worker, task)


class MisnumberingBackend(ProcessBackend):
    """Worker processes whose answers, from the third on, name a ticket no task has."""

    name = "misnumbering-processes"

    def receive(self, events):
        received = super().receive(events)
        arrivals = []
        for arrival in received.arrivals:
            self.answered = getattr(self, "answered", 0) + 1
            if self.answered > 2:
                arrival = dataclasses.replace(arrival, ticket=arrival.ticket + 1_000_000)
            arrivals.append(arrival)
        return dataclasses.replace(received, arrivals=tuple(arrivals))


class SequentialBackend(ProcessBackend):
    """Worker processes that run a task's samples one at a time only."""

    name = "sequential-processes"
    concurrent_samples = False


@pytest.fixture(scope="module", autouse=True)
def registered():
    # Registered for this module's tests only: other tests see the built-in names alone.
    for backend in (RecordingBackend, SequentialBackend, MisnumberingBackend):
        register_backend(backend.name, backend)
    yield
    for backend in (RecordingBackend, SequentialBackend, MisnumberingBackend):
        unregister_backend(backend.name)


def test_an_unregistered_backend_is_no_longer_offered():
    register_backend("gone-processes", ProcessBackend)
    unregister_backend("gone-processes")
    assert "gone-processes" not in backend_names()
    with pytest.raises(ValueError, match="backend must be one of .*got 'gone-processes'"):
        WorkerPool(1, backend="gone-processes")
    with pytest.raises(ValueError, match="built in"):
        unregister_backend("processes")


def test_a_registered_backend_is_offered_by_name_and_runs_sources():
    assert RecordingBackend.name in backend_names()
    with ParallelSource(sample_of, 4, pool=extsrc.PoolSpec(num_workers=2, backend=RecordingBackend.name)) as source:
        batch = next(iter(source))
    assert [int(sample[0]) for sample in batch] == [0, 1, 2, 3]


def test_the_tasks_of_two_sources_on_one_pool_never_share_a_ticket():
    # A backend tells tasks apart by ticket alone: two sources' tasks with one ticket would
    # mix up their answers (one taken for the other, the other unknown).
    RecordingBackend.assigned.clear()
    pool = WorkerPool(2, backend=RecordingBackend.name)
    a = ParallelSource(sample_of, 2, pool=pool)
    b = ParallelSource(lambda info: np.array([-info.idx_in_epoch]), 3, pool=pool)
    try:
        ia, ib = iter(a), iter(b)
        for _ in range(6):
            assert len(next(ia)) == 2 and len(next(ib)) == 3
    finally:
        a.close()
        b.close()
        pool.close()
    sources = {source for source, _ in RecordingBackend.assigned}
    tickets = [ticket for _, ticket in RecordingBackend.assigned]
    assert len(sources) == 2
    assert len(set(tickets)) == len(tickets)


def test_concurrency_is_refused_on_a_backend_whose_workers_run_one_sample_at_a_time():
    pool = WorkerPool(1, backend=SequentialBackend.name)
    try:
        with pytest.raises(ValueError, match="concurrency=4 .* backend='sequential-processes'"):
            ParallelSource(sample_of, 2, pool=pool, concurrency=4)
    finally:
        pool.close()


def test_a_backend_that_answers_a_ticket_no_task_has_breaks_the_pool_at_once():
    # Unchecked, such answers were taken, batches came, and the epoch waited for ever for the
    # answers that never came (no timeout= given).
    with ParallelSource(sample_of, 2, pool=extsrc.PoolSpec(num_workers=2, backend=MisnumberingBackend.name),
                        order=extsrc.Order(64)) as source:
        with pytest.raises(InternalError, match=r"answered ticket \d+ of source \d+ for worker \d, "
                                                r"and that worker holds no such task"):
            for _ in source:
                pass
