"""Unit tests: shared-memory segments, mappings and the arrays over them."""

import gc
import os

import numpy as np
import pytest

from extsrc.errors import SharedMemoryError
from extsrc.shm import limits
from extsrc.shm.mapping import Mapping, array_base, owner_of, view
from extsrc.shm import segment as segment_module
from extsrc.shm.segment import Segment

from procs import named_shm_in_use, own_shm_entries


def test_a_segment_is_reserved_in_whole_pages_and_only_grows():
    segment = Segment.create("unit")
    try:
        assert segment.size == 0
        assert segment.reserve(10) == os.sysconf("SC_PAGE_SIZE")
        assert segment.reserve(5) == os.sysconf("SC_PAGE_SIZE")  # never shrinks
        assert segment.reserve(3 << 20) == 3 << 20
    finally:
        segment.close()
    assert segment.fd == -1


def test_two_mappings_of_a_segment_see_the_same_bytes():
    segment = Segment.create("unit")
    segment.reserve(1 << 16)
    a, b = segment.map(), segment.map()
    a.array(128, np.dtype(np.int32), (4,))[:] = [1, 2, 3, 4]
    assert b.array(128, np.dtype(np.int32), (4,)).tolist() == [1, 2, 3, 4]
    segment.close()  # mappings outlive the descriptor
    assert a.array(128, np.dtype(np.int32), (4,)).tolist() == [1, 2, 3, 4]


def test_an_array_keeps_its_owner_and_the_mapping_alive():
    segment = Segment.create("unit")
    segment.reserve(1 << 16)
    mapping = segment.map()

    class Owner:
        def __init__(self, mapping):
            self.mapping = mapping

    owner = Owner(mapping)
    array = view(array_base(mapping, owner), 64, np.dtype(np.float64), (2, 3))
    array[:] = 7.0
    assert owner_of(array) is owner and owner_of(array[1:][0]) is owner
    del owner, mapping
    gc.collect()
    assert array.sum() == 42.0  # still mapped: the array holds the owner, which holds the mapping
    assert owner_of(np.zeros(3)) is None


def test_mapping_more_than_the_address_space_limit_is_a_shared_memory_error(monkeypatch):
    monkeypatch.setattr(limits, "_address_space", lambda: limits.Limit("RLIMIT_AS (test)", 1 << 30, 1 << 29))
    segment = Segment.create("unit")
    try:
        with pytest.raises(SharedMemoryError, match="RLIMIT_AS"):
            segment.map(1 << 30)
    finally:
        segment.close()


def test_reserving_past_the_tightest_limit_is_refused_before_anything_is_allocated(monkeypatch):
    small = limits.Limit("the memory cgroup /test (memory.max)", 256 << 20, 150 << 20)
    monkeypatch.setattr(limits, "memory_limits", lambda: [small])
    segment = Segment.create("source 'x', slot 0")
    try:
        with pytest.raises(SharedMemoryError) as caught:
            segment.reserve(100 << 20, total_needed=400 << 20)
        message = str(caught.value)
        assert "cannot reserve 100.0 MiB more shared memory for source 'x', slot 0" in message
        assert "256.0 MiB, 150.0 MiB in use" in message and "needs about 400.0 MiB" in message
        assert "container's memory limit" in message
        assert segment.size == 0  # nothing was allocated
        assert segment.reserve(16 << 20) == 16 << 20  # what fits under the headroom is fine
    finally:
        segment.close()


def test_cgroup_limits_are_read_from_this_process_and_its_parents():
    found = limits.memory_limits()
    assert any(limit.name.startswith("the machine's memory") for limit in found)
    for limit in found:
        assert limit.limit > 0 and 0 <= limit.room <= limit.limit


def test_the_dev_shm_backend_leaves_no_name_in_dev_shm(monkeypatch):
    monkeypatch.setenv("EXTSRC_SHM_BACKEND", "devshm")
    segment = Segment.create("unit")
    assert segment.kind == "devshm"
    assert named_shm_in_use([os.getpid()]) == [] and own_shm_entries([os.getpid()]) == set()
    segment.close()


def test_a_closed_mapping_is_no_base_for_arrays():
    segment = Segment.create("unit")
    segment.reserve(4096)
    mapping = segment.map()
    mapping.close()
    with pytest.raises(ValueError, match="closed"):
        array_base(mapping, mapping)
    segment.close()
    assert isinstance(mapping, Mapping)


def test_a_close_interrupted_wherever_a_ctrl_c_can_land_closes_its_descriptor_once():
    from interrupting import cut_at_landing

    walked = 0
    while True:  # k-th place in Segment.close where a Ctrl-C can land, for every k
        walked += 1
        segment = Segment.create("test-interrupted-close")
        fd = segment.fd
        _, over = cut_at_landing(walked, segment_module.__file__, segment.close)
        read_end, write_end = os.pipe()  # the lowest free numbers: the one just closed, if it was
        try:
            segment.close()  # called again (as by __del__, or a second close())
            os.fstat(read_end)  # a reused number closed by the second close(): OSError EBADF
            os.fstat(write_end)
            if fd not in (read_end, write_end):  # not closed by the first: by the second, then
                with pytest.raises(OSError):
                    os.fstat(fd)
        finally:
            os.close(read_end)
            os.close(write_end)
        if over:
            break
    assert walked > 3
