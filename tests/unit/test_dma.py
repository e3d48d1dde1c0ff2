"""Unit tests of extsrc.dma on real sources, with the CUDA calls and events stood in for:
page-locking follows every mapping of a source, and host batches live until their copies are done."""

import gc
import threading
import time

import numpy as np
import pytest

from extsrc import Order, ParallelSource
from extsrc.dma import InFlight, page_lock


def big(info):
    return np.full((1 << 16,), info.record % 256, np.uint8)


class Runtime:
    """Stands for cudaHostRegister / cudaHostUnregister: records what is registered."""

    def __init__(self, fail_above=None):
        self.lock = threading.Lock()  # the pool's thread maps and unmaps while the test looks
        self.registered = {}
        self.errors = []
        self.fail_above = fail_above

    def register(self, address, size):
        if self.fail_above is not None and size > self.fail_above:
            raise RuntimeError("cudaErrorMemoryAllocation")
        with self.lock:
            if address in self.registered:
                self.errors.append(f"{address:#x} registered twice")
            self.registered[address] = size

    def unregister(self, address):
        with self.lock:
            if self.registered.pop(address, None) is None:
                self.errors.append(f"{address:#x} unregistered without being registered")

    def snapshot(self):
        with self.lock:
            return dict(self.registered)


def _maps_of(address):
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def test_every_mapping_is_registered_once_and_unregistered_while_still_mapped():
    runtime = Runtime()
    unmapped_too_early = []

    def unregister(address):
        if not _maps_of(address):
            unmapped_too_early.append(address)
        runtime.unregister(address)

    source = ParallelSource(big, 8, num_workers=2, order=Order(200))
    source.start()
    lock = page_lock(source, "test", runtime.register, unregister)
    assert page_lock(source, "other", runtime.register, unregister) is lock  # once per source
    kept = []
    for i, batch in enumerate(source):
        if i % 5 == 0:
            kept.append(batch)  # held batches make the engine map more slots
        lock.check()
    registered = runtime.snapshot()
    assert registered and lock.registered_bytes() > 0
    # every batch held lives in registered memory (the first is a copy: it sized the memory)
    for held in kept[1:]:
        address = held.as_array().ctypes.data
        assert any(a <= address < a + size for a, size in registered.items())
    source.close()
    del kept, batch, held
    gc.collect()
    deadline = time.monotonic() + 5
    while runtime.registered and time.monotonic() < deadline:
        time.sleep(0.01)
        gc.collect()
    assert runtime.snapshot() == {} and unmapped_too_early == [] and runtime.errors == []


def test_a_failed_registration_is_raised_by_check_and_the_batches_stay_right():
    runtime = Runtime(fail_above=0)
    with ParallelSource(big, 8, num_workers=1, order=Order(40)) as source:
        source.start()
        lock = page_lock(source, "test", runtime.register, runtime.unregister)
        epoch = iter(source)
        first = next(epoch)
        with pytest.raises(RuntimeError, match=r"could not page-lock.*cudaErrorMemoryAllocation.*pin_memory=False"):
            lock.check()
        lock.check()  # raised once per failure
        assert [int(b[0][0]) for b in epoch] == [8, 16, 24, 32]
        assert int(first[0][0]) == 0


class Event:
    """Stands for a CUDA event: done when the test says so."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_host_batches_are_kept_until_their_copy_events_complete():
    in_flight = InFlight()
    with ParallelSource(big, 4, num_workers=2, order=Order(400)) as source:
        epoch = iter(source)
        events = []
        for _ in range(3):
            batch = next(epoch)
            value = int(batch[0][0])
            event = Event()
            in_flight.add(event, batch)
            events.append((event, batch.as_array()[:, :8].ctypes.data, value))
            del batch
        for _ in range(40):  # the engine would reuse any memory nobody holds
            next(epoch)
        for _event, address, value in events:  # still unchanged: the copies may be reading
            assert (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 8).from_address(address)) == value).all()
        events[0][0].done = True
        in_flight.release_done()
        assert len(in_flight) == 2
        in_flight.wait_all()
        assert len(in_flight) == 0 and all(event.done for event, _, _ in events)
