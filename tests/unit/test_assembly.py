"""Unit tests: putting a batch together from its tasks' results."""

import pickle

import numpy as np
import pytest

from extsrc.engine.assembly import PendingBatch
from extsrc.engine.protocol import TaskDone, TaskFailed
from extsrc.errors import CallbackError, WorkerTraceback
from extsrc.sample_info import SampleInfo
from extsrc.shm.layout import LayoutPlan, Spilled
from extsrc.shm.slots import SlotPool


class Link:
    def add_slot(self, *args):
        pass

    def drop_slot(self, *args):
        pass


@pytest.fixture
def slots():
    pool = SlotPool(0, "source 'unit'", num_workers=2, keep=4, link=Link())
    yield pool
    pool.close(tell_workers=False)


def done(ticket, worker, count, stopped=False, spilled=((),), overflow=0):
    return TaskDone(0, ticket, worker, count, stopped, spilled, overflow)


def failed(ticket, worker, position, error=None, where=None):
    payload = None if error is None else pickle.dumps(error)
    return TaskFailed(0, ticket, worker, position, where, payload, "ValueError", "bad", "Traceback ...", True)


def pending_of(slots, ranges, region=True):
    plan = LayoutPlan(1, 8)
    if region:
        plan.learn(0, ("<i8", (2,)))
    regions, size = plan.regions()
    slot = slots.acquire(max(size, 1), size * 4, batch_seq=0)
    pending = PendingBatch(0, 0, 3, slot, regions)
    for ticket, (start, stop) in enumerate(ranges):
        pending.expect(ticket, start, stop)
    return pending


def test_a_batch_is_complete_only_when_every_task_reported(slots):
    pending = pending_of(slots, [(0, 4), (4, 8)])
    pending.add(done(1, 1, 4))
    assert not pending.complete
    pending.add(done(0, 0, 4))
    assert pending.complete and pending.decide("drop", "#0").size == 8


def test_the_earliest_failing_sample_wins_whatever_order_results_came(slots):
    pending = pending_of(slots, [(0, 4), (4, 8)])
    pending.add(failed(1, 1, 5, ValueError("late")))
    pending.add(failed(0, 0, 2, ValueError("early"), SampleInfo(26, 2, 3, 0)))
    error = pending.decide("drop", "#0").error
    assert str(error) == "early" and isinstance(error.__cause__, WorkerTraceback)
    assert "SampleInfo(idx_in_epoch=26" in error.__cause__.text


def test_an_end_of_epoch_before_a_failure_hides_the_failure(slots):
    pending = pending_of(slots, [(0, 4), (4, 8)])
    pending.add(done(0, 0, 3, stopped=True))
    pending.add(failed(1, 1, 5, ValueError("after the end")))
    assert pending.decide("partial", "#0") .size == 3
    assert pending.decide("drop", "#0").size == 0 and pending.decide("drop", "#0").produced == 3


def test_an_exception_that_does_not_pickle_becomes_a_callback_error(slots):
    pending = pending_of(slots, [(0, 8)])
    pending.add(failed(0, 0, 0))
    error = pending.decide("drop", "#0").error
    assert isinstance(error, CallbackError) and str(error) == "ValueError: bad"


def test_in_place_results_build_one_dense_array_and_spilled_ones_a_list(slots):
    pending = pending_of(slots, [(0, 4), (4, 8)])
    slot = pending.slot
    writable = slot.region_map.array(0, np.dtype("<i8"), (8, 2))
    writable[:] = np.arange(16).reshape(8, 2)
    pending.add(done(0, 0, 4))
    pending.add(done(1, 1, 4))
    slots.filled(slot)
    lease = slots.take(slot, pending.overflow_sizes(8))
    batch = pending.build(lease, 8, None)
    assert batch.is_dense and batch.as_array()[:, 0].tolist() == list(range(0, 16, 2))


def test_spilled_samples_are_read_from_the_writing_workers_overflow(slots):
    pending = pending_of(slots, [(0, 2), (2, 4)], region=False)
    slot = pending.slot
    slot.overflow[1].reserve(4096)
    slot.overflow[1].map().array(64, np.dtype("<f4"), (3,))[:] = [1.5, 2.5, 3.5]
    slot.overflow[0].reserve(4096)
    slot.overflow[0].map().array(0, np.dtype("<f4"), (1,))[:] = [9.0]
    pending.add(done(0, 0, 2, spilled=((Spilled(0, "<f4", (1,), 0), Spilled(1, "<f4", (1,), 0)),), overflow=4096))
    pending.add(done(1, 1, 1, stopped=True, spilled=((Spilled(2, "<f4", (3,), 64),),), overflow=4096))
    decision = pending.decide("partial", "#0")
    assert decision.size == 3 and decision.ended
    slots.filled(slot)
    lease = slots.take(slot, pending.overflow_sizes(3))
    batch = pending.build(lease, 3, None)
    assert not batch.is_dense and [s.tolist() for s in batch] == [[9.0], [9.0], [1.5, 2.5, 3.5]]
    with pytest.raises(ValueError, match="sample 2 has shape \\(3,\\) where sample 0 has \\(1,\\)"):
        batch.as_array()
