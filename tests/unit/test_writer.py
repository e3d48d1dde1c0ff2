"""Unit tests: how a worker writes samples into a slot (in place, or spilled to overflow)."""

import os

import numpy as np
import pytest

from extsrc.engine.samples import SampleChecker
from extsrc.errors import SampleError
from extsrc.shm.layout import LayoutPlan
from extsrc.shm.segment import Segment
from extsrc.shm.writer import TaskWriter


@pytest.fixture
def slot():
    """A slot as a worker sees it: region and overflow segments, and a reader's view."""
    region, overflow = Segment.create("region"), Segment.create("overflow")
    region.reserve(1 << 20)
    writer = TaskWriter("source 'unit'", SampleChecker(None, (None,), (None,)), batch_size=4)
    writer.add_slot(7, os.dup(region.fd), os.dup(overflow.fd), "memfd", worker=0)
    yield writer, region, overflow
    writer.close()
    region.close()
    overflow.close()


def describe(position):
    return f"sample {position}"


def test_uniform_samples_go_in_place_and_nothing_spills(slot):
    writer, region, _ = slot
    plan = LayoutPlan(1, 4)
    plan.learn(0, ("<i4", (3,)))
    regions, size = plan.regions()
    samples = [np.full(3, k, np.int32) for k in range(2)]
    spilled, overflow = writer.write(7, 0, 2, 4, size, regions, [samples], 2, describe)
    assert spilled == ((),) and overflow == 0
    written = region.map().array(regions[0].offset, np.dtype("<i4"), (4, 3))
    assert written[2:].tolist() == [[0, 0, 0], [1, 1, 1]]


def test_samples_that_do_not_fit_their_region_spill_to_overflow(slot):
    writer, _, overflow = slot
    plan = LayoutPlan(1, 4)
    plan.learn(0, ("<i4", (3,)))
    regions, size = plan.regions()
    samples = [np.full(3, 1, np.int32), np.full(5, 2, np.int32), np.full(3, 3, np.int32)]
    spilled, used = writer.write(7, 0, 0, 4, size, regions, [samples], 3, describe)
    assert [s.position for s in spilled[0]] == [1]  # the others are in place
    placed = spilled[0][0]
    assert overflow.map().array(placed.offset, np.dtype(placed.dtype), placed.shape).tolist() == [2] * 5
    assert used == placed.offset + 5 * 4


def test_without_a_region_every_sample_spills_and_a_new_batch_starts_over(slot):
    writer, _, _ = slot
    samples = [np.arange(k + 1, dtype=np.uint8) for k in range(3)]
    spilled, used = writer.write(7, 0, 0, 4, 0, (None,), [samples], 3, describe)
    assert [s.shape for s in spilled[0]] == [(1,), (2,), (3,)]
    spilled2, used2 = writer.write(7, 1, 0, 4, 0, (None,), [samples], 3, describe)
    assert spilled2[0][0].offset == 0 and used2 == used  # batch 1 reuses the area from its start


def test_an_invalid_sample_names_its_position_and_output(slot):
    writer, _, _ = slot
    with pytest.raises(SampleError, match="sample 2, output 0: expected a NumPy array of numbers, got str") as caught:
        writer.write(7, 0, 1, 4, 0, (None,), [[np.zeros(2), "oops"]], 2, describe)
    assert caught.value.position == 2


def test_a_byte_order_mismatch_is_named_as_such():
    checker = SampleChecker(None, ("<i4",), (None,))
    with pytest.raises(SampleError) as caught:
        checker.check(np.zeros(2, ">i4"), 0, 0, "sample {}".format, None, 0)
    message = str(caught.value)
    assert "expected dtype int32 (little-endian, '<i4')" in message
    assert "got int32 (big-endian, '>i4')" in message


def test_samples_of_one_output_must_share_dtype_and_ndim():
    checker = SampleChecker(None, (None,), (None,))
    first = checker.check(np.zeros((2, 2)), 0, 0, "sample {}".format, None, 0)
    with pytest.raises(SampleError, match="2 dimensions like sample 0, got dtype float64 with shape \\(2,\\)"):
        checker.check(np.zeros(2), 0, 1, "sample {}".format, first, 0)


@pytest.mark.parametrize("count", [1, 3])
def test_large_samples_arrive_whole_in_place_one_or_several_at_a_time(count):
    # Samples of 1 MiB and more take the copy past the caches (extsrc.shm.streaming): their
    # bytes, odd lengths included, must land exactly in their rows and nowhere else.
    region, overflow = Segment.create("region"), Segment.create("overflow")
    writer = TaskWriter("source 'unit'", SampleChecker(None, (None,), (None,)), batch_size=4)
    try:
        plan = LayoutPlan(1, 4)
        plan.learn(0, ("|u1", ((1 << 20) + 3,)))
        regions, size = plan.regions()
        region.reserve(size)
        writer.add_slot(7, os.dup(region.fd), os.dup(overflow.fd), "memfd", worker=0)
        view = region.map().array(0, np.dtype("u1"), (size,))
        view[:] = 0xEE
        rng = np.random.default_rng(count)
        samples = [rng.integers(0, 256, (1 << 20) + 3, dtype=np.uint8) for _ in range(4)]
        for start in range(0, 4, count):
            chunk = samples[start:start + count]
            spilled, _ = writer.write(7, 0, start, 4, size, regions, [chunk], len(chunk), describe)
            assert spilled == ((),)
        rows = region.map().array(regions[0].offset, np.dtype("u1"), (4, (1 << 20) + 3))
        for k in range(4):
            assert np.array_equal(rows[k], samples[k]), f"row {k}"
        after = regions[0].offset + 4 * regions[0].stride
        assert (view[after:] == 0xEE).all()  # the padding after the last row is untouched
    finally:
        writer.close()
        region.close()
        overflow.close()


def test_overflow_given_back_by_the_consumer_is_reserved_again_before_a_write(slot):
    # The consumer gives back overflow no recent batch uses (SlotPool.fit_overflow); a worker
    # that counted it as reserved would write into pages nobody reserved, and running short
    # would be a SIGBUS in the copy instead of a SharedMemoryError before it.
    writer, _, overflow = slot
    big = np.ones(4 << 20, np.uint8)
    writer.write(7, 0, 0, 1, 0, (None,), [[big]], 1, describe)
    assert overflow.allocated >= big.nbytes
    overflow.give_back(0)  # what the consumer does, on its own descriptor
    assert overflow.allocated == 0
    seen = []
    real_fallocate = os.posix_fallocate
    try:
        os.posix_fallocate = lambda fd, offset, length: (seen.append(os.fstat(fd).st_blocks * 512),
                                                          real_fallocate(fd, offset, length))[1]
        writer.write(7, 1, 0, 1, 0, (None,), [[big]], 1, describe)
    finally:
        os.posix_fallocate = real_fallocate
    assert seen == [0]  # reserved again, before anything was written
    assert overflow.allocated >= big.nbytes
