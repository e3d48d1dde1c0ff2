"""Unit tests: the slot pool's states, leases and memory."""

import gc

import numpy as np
import pytest

from extsrc.errors import InternalError
from extsrc.shm.slots import SlotPool, SlotState


class Link:
    """Records what a slot pool tells the workers."""

    def __init__(self):
        self.added, self.dropped = [], []

    def add_slot(self, source_id, slot_id, region_fd, overflow_fds):
        assert region_fd >= 0 and len(overflow_fds) == 2
        self.added.append(slot_id)

    def drop_slot(self, source_id, slot_id):
        self.dropped.append(slot_id)


@pytest.fixture
def pool():
    link = Link()
    slots = SlotPool(0, "source 'unit'", num_workers=2, keep=2, link=link)
    yield slots, link
    slots.close(tell_workers=False)


def lease_a_batch(slots, seq):
    slot = slots.acquire(4096, 4096 * 3, batch_seq=seq)
    slots.filled(slot)
    return slot, slots.take(slot, {})


def test_a_slot_goes_free_filling_ready_leased_and_back_when_its_last_array_dies(pool):
    slots, link = pool
    slot = slots.acquire(4096, 8192, batch_seq=0)
    assert slot.state is SlotState.FILLING and link.added == [slot.slot_id]
    slots.filled(slot)
    assert slot.state is SlotState.READY
    lease = slots.take(slot, {})
    assert slot.state is SlotState.LEASED
    array = lease.base(lease.region)[:16]
    del lease
    slots.process_returns()
    assert slot.state is SlotState.LEASED  # an array still lives
    view = array[4:8]
    del array
    slots.process_returns()
    assert slot.state is SlotState.LEASED  # and a view of it
    del view
    slots.process_returns()
    assert slot.state is SlotState.FREE


def test_the_pool_counts_the_batches_finished_and_not_taken(pool):
    slots, _ = pool
    first = slots.acquire(4096, 8192, batch_seq=0)
    second = slots.acquire(4096, 8192, batch_seq=1)
    assert slots.ready == 0
    slots.filled(first)
    slots.filled(second)
    assert slots.ready == 2 == slots.count(SlotState.READY)
    lease = slots.take(first, {})
    assert slots.ready == 1
    slots.abandon(second)  # an epoch that ended with it unread
    assert slots.ready == 0 == slots.count(SlotState.READY)
    del lease


def test_a_free_slot_is_reused_before_a_new_one_is_made(pool):
    slots, link = pool
    slot, lease = lease_a_batch(slots, 0)
    del lease
    slots.process_returns()
    again = slots.acquire(4096, 8192, batch_seq=1)
    assert again is slot and link.added == [slot.slot_id]


def test_batches_kept_beyond_keep_leave_the_pool_with_their_memory_intact(pool):
    slots, link = pool
    kept = []
    for seq in range(6):
        slot, lease = lease_a_batch(slots, seq)
        lease.base(lease.region)[:8] = seq  # the batch's contents
        kept.append(lease.base(lease.region)[:8])
        del lease
        assert len(slots.slots) <= 2  # keep=2: no more slots, nor descriptors, however many kept
    assert slots.held == 6 and len(link.dropped) == 4  # the workers dropped the ones that left
    for seq, array in enumerate(kept):
        assert (array == seq).all()  # every kept batch still reads what was written
    assert slots.reserved_bytes() >= 6 * 4096 and len(slots.capacities()) == 6  # still counted
    del kept, array
    gc.collect()
    slots.process_returns()
    assert slots.held == 0
    assert slots.reserved_bytes() <= 2 * 4096 * 3 and len(slots.capacities()) == 2
    assert all(slot.state is SlotState.FREE for slot in slots.slots.values())


def test_a_wrong_transition_is_an_internal_error(pool):
    slots, _ = pool
    slot = slots.acquire(4096, 8192, batch_seq=0)
    with pytest.raises(InternalError, match="leased while filling"):
        slots.take(slot, {})


def test_an_abandoned_filling_slot_drains_before_it_is_free(pool):
    slots, _ = pool
    slot = slots.acquire(4096, 8192, batch_seq=0)
    slots.abandon(slot)
    assert slot.state is SlotState.DRAINING
    assert slots.acquire(4096, 8192, batch_seq=1) is not slot  # workers may still write
    slots.filled(slot)
    assert slot.state is SlotState.FREE


def test_a_lease_never_committed_changes_nothing_and_its_death_is_ignored(pool):
    slots, _ = pool
    slot = slots.acquire(4096, 8192, batch_seq=0)
    slots.filled(slot)
    lease = slots.lease(slot, {})  # a take prepared, then interrupted before its commit
    assert slot.state is SlotState.READY and slots.holds(slot, 0, lease)
    del lease
    slots.process_returns()
    assert slot.state is SlotState.READY
    new_lease = slots.take(slot, {})
    assert slot.state is SlotState.LEASED and new_lease.seq == slot.lease_seq


def test_a_commit_run_again_after_an_interrupt_leases_the_slot_once(pool):
    slots, _ = pool
    slot = slots.acquire(4096, 8192, batch_seq=0)
    slots.filled(slot)
    lease = slots.lease(slot, {})
    slot.lease_seq = lease.seq  # as if a commit was cut short before its state change
    assert slots.holds(slot, 0, lease)
    slots.commit(slot, lease)
    slots.commit(slot, lease)  # applied again by the next call: nothing more happens
    assert slot.state is SlotState.LEASED and slots.held == 1
    other = slots.lease  # a second take of the same batch is refused
    with pytest.raises(InternalError, match="leased while leased"):
        other(slot, {})
    del lease
    slots.process_returns()
    assert slot.state is SlotState.FREE


def test_close_gives_back_free_memory_and_leaves_held_batches_readable():
    link = Link()
    slots = SlotPool(0, "source 'unit'", num_workers=2, keep=2, link=link)
    slot, lease = lease_a_batch(slots, 0)
    array = np.ndarray((4,), np.int64, buffer=lease.base(lease.region), offset=0)
    array[:] = [1, 2, 3, 4]
    lease_a_batch(slots, 1)  # its lease dies at once
    slots.close(tell_workers=True)
    assert slots.slots == {} and len(link.dropped) == 2
    del lease
    assert array.tolist() == [1, 2, 3, 4]


def test_watchers_see_every_mapping_made_and_every_mapping_before_it_goes(pool):
    slots, _ = pool
    first, lease = lease_a_batch(slots, 0)
    mapped, unmapped = [], []
    slots.watch(lambda address, size: mapped.append((address, size)),
                lambda address, size: unmapped.append((address, size)))
    assert mapped == [(first.region_map.address, first.region_map.size)]
    second, lease2 = lease_a_batch(slots, 1)  # a new slot: mapped while watched
    assert (second.region_map.address, second.region_map.size) in mapped and len(mapped) == 2
    del lease, lease2
    slots.process_returns()
    slots.close(tell_workers=False)
    gc.collect()
    assert sorted(unmapped) == sorted(mapped)  # each unregistered before it was unmapped


def test_a_batch_whose_slot_left_the_pool_while_leased_is_still_its_leases(pool):
    # A take committed and not yet handed over when the pool thread lets its slot go (the
    # consumer holds every slot): applying the take again must find it still held, or the
    # batch would be dropped and the loop wait for it for ever.
    slots, _ = pool
    first, first_lease = lease_a_batch(slots, 0)
    _, second_lease = lease_a_batch(slots, 1)
    lease_a_batch(slots, 2)  # every slot held: the first one leaves the pool
    assert first.state is SlotState.RETIRED and first.slot_id not in slots.slots
    assert slots.holds(first, 0, first_lease)
    slots.commit(first, first_lease)  # applied again after an interrupt: nothing changes
    assert first.state is SlotState.RETIRED and slots.held >= 2
    assert not slots.holds(first, 0, second_lease) and not slots.holds(first, 1, first_lease)


def _spill(slot, worker, nbytes):
    """As a worker writing ``nbytes`` of overflow into ``slot`` would leave its segment."""
    slot.overflow[worker].reserve(nbytes)
    return nbytes


def test_overflow_a_worker_left_in_a_slot_goes_back_once_recent_batches_are_small(pool):
    # Worker 1 wrote 16 MiB of ragged samples into slot A, then only worker 0 writes, small
    # batches into slot B: A's memory must not wait for worker 1 to write to A again.
    slots, _ = pool
    big = 16 << 20
    first = slots.acquire(4096, 4096, batch_seq=0)
    a = slots.acquire(4096, 4096, batch_seq=1)
    slots.filled(a)
    slots.fit_overflow(a, {0: 0, 1: _spill(a, 1, big)})
    slots.abandon(a)  # nobody reads it any more: FREE
    slots.abandon(first)
    slots.filled(first)
    assert a.overflow[1].allocated >= big
    for seq in range(2, 5):
        b = slots.acquire(4096, 4096, batch_seq=seq)
        assert b is first  # a waits FREE
        slots.filled(b)
        slots.fit_overflow(b, {0: _spill(b, 0, 4096)})
        slots.abandon(b)
    assert a.overflow[1].allocated < big // 8  # given back (1 MiB kept)


def test_a_slot_written_by_each_worker_in_turn_holds_the_overflow_of_its_writer_only(pool):
    # Tasks go to whichever worker is free, so a slot's batches come from each worker in turn:
    # the slot held a batch's overflow for each of them, twice what its batches need.
    slots, _ = pool
    big = 16 << 20
    a = slots.acquire(4096, 4096, batch_seq=0)
    slots.filled(a)
    slots.fit_overflow(a, {0: _spill(a, 0, big), 1: 0})
    slots.abandon(a)
    b = slots.acquire(4096, 4096, batch_seq=1)
    assert b is a
    slots.filled(b)
    slots.fit_overflow(b, {0: 0, 1: _spill(b, 1, big)})  # the same batch size, from worker 1
    assert a.overflow[1].allocated >= big  # its batch lies there
    assert a.overflow[0].allocated <= 1 << 20  # worker 0's given back, but for 1 MiB


def test_overflow_a_batch_is_read_from_or_is_watched_is_never_given_back(pool):
    slots, _ = pool
    big = 16 << 20
    a = slots.acquire(4096, 4096, batch_seq=0)
    slots.filled(a)
    slots.fit_overflow(a, {1: _spill(a, 1, big)})  # READY: its batch lies in worker 1's overflow
    for seq in range(1, 4):
        b = slots.acquire(4096, 4096, batch_seq=seq)
        slots.filled(b)
        slots.fit_overflow(b, {0: _spill(b, 0, 4096)})
        slots.abandon(b)
    assert a.state is SlotState.READY and a.overflow[1].allocated >= big
    slots.abandon(a)
    slots.watch(lambda address, size: None, lambda address, size: None)
    b = slots.acquire(4096, 4096, batch_seq=9)
    slots.filled(b)
    slots.fit_overflow(b, {0: _spill(b, 0, 4096)})
    assert a.overflow[1].allocated >= big  # page-locked memory is kept
