"""Samples written once: a callback that writes straight into the batch's shared memory."""

import os

import numpy as np
import pytest

from extsrc import Order, ParallelSource, SampleError, SharedMemoryError
from extsrc.shm.slots import lease_of


def copying(info):
    return np.full((3, 4), info.idx_in_epoch, np.int32), np.arange(info.idx_in_batch + 1, dtype=np.float32)


def filling(info, buffers):
    image = buffers.array((3, 4), np.int32)
    image[...] = info.idx_in_epoch
    ragged = buffers.array(info.idx_in_batch + 1, np.float32, output=1)
    ragged[:] = np.arange(info.idx_in_batch + 1)
    return image, ragged


def batches(source, **kwargs):
    with ParallelSource(source, 5, num_outputs=2, num_workers=2, **kwargs) as src:
        it = iter(src)
        return [next(it) for _ in range(6)]


def test_in_place_gives_the_same_batches_as_copying_dense_and_ragged():
    copied, written = batches(copying), batches(filling, in_place=True)
    for (a_images, a_ragged), (b_images, b_ragged) in zip(copied, written):
        assert b_images.is_dense and np.array_equal(a_images.as_array(), b_images.as_array())
        assert [r.tolist() for r in a_ragged] == [r.tolist() for r in b_ragged]
        assert lease_of(b_ragged[0]) is not None  # shared memory, zero-copy


def test_a_sample_written_in_place_is_not_copied(tmp_path):
    path = tmp_path / "record.bin"
    path.write_bytes(bytes(range(256)) * 64)

    class ReadInto:
        def __call__(self, info, buffers):
            with open(path, "rb") as f:
                buffer = buffers.array(os.path.getsize(path), np.uint8)
                f.readinto(buffer)
            self.last = buffer.__array_interface__["data"][0]
            return buffer

    with ParallelSource(ReadInto(), 4, num_workers=1, in_place=True) as src:
        it = iter(src)
        for _ in range(3):
            batch = next(it)
        assert batch.is_dense and batch.as_array().shape == (4, 16384)
        assert batch.as_array()[:, :4].tolist() == [[0, 1, 2, 3]] * 4


def test_returning_another_array_still_works_and_is_copied():
    def sometimes(info, buffers):
        if info.idx_in_epoch % 2:
            return np.full(6, info.idx_in_epoch, np.int64)
        out = buffers.array(6, np.int64)
        out[:] = info.idx_in_epoch
        return out

    with ParallelSource(sometimes, 4, num_workers=2, in_place=True) as src:
        it = iter(src)
        got = [next(it).as_array()[:, 0].tolist() for _ in range(4)]
    assert got == [list(range(k, k + 4)) for k in range(0, 16, 4)]


def test_an_in_place_sample_of_the_wrong_dtype_is_named_like_a_copied_one():
    def wrong(info, buffers):
        return buffers.array(4, np.float64)

    with ParallelSource(wrong, 4, in_place=True, dtype=np.uint8) as src:
        with pytest.raises(SampleError, match=r"sample SampleInfo\(idx_in_epoch=0.*output 0: expected dtype uint8 \(as declared\), got float64"):
            next(iter(src))


def test_in_place_with_an_order_and_with_spawn():
    def fill_record(info, buffers):
        out = buffers.array(2, np.int64)
        out[:] = [info.record, info.idx_in_epoch]
        return out

    order = Order(40, shuffle=True, seed=2)
    with ParallelSource(fill_record, 8, num_workers=2, start_method="spawn", order=order,
                        in_place=True) as src:
        samples = np.concatenate([b.as_array() for b in src])
    assert samples[:, 0].tolist() == list(order.epoch(0)) and samples[:, 1].tolist() == list(range(40))


def test_in_place_needs_sample_mode():
    with pytest.raises(ValueError, match="in_place=True .* needs batch=False"):
        ParallelSource(lambda i: [np.zeros(1)], 4, batch=True, in_place=True)


def test_large_samples_are_written_one_by_one_so_the_worker_reuses_its_memory():
    def fresh(info):
        sample = np.empty(4 << 20, np.uint8)  # a fresh 4 MiB array per sample, as real callbacks make
        sample.fill(info.idx_in_epoch % 251)
        return sample

    def minor_faults(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])

    with ParallelSource(fresh, 8, num_workers=1) as src:
        it = iter(src)
        for _ in range(10):
            next(it)
        worker = src.worker_pids()[0]
        before = minor_faults(worker)
        for i in range(10):
            assert int(next(it)[7][0]) == (10 * 8 + 8 * i + 7) % 251
        per_sample = (minor_faults(worker) - before) / 80
    assert per_sample < 256, f"{per_sample:.0f} page faults per 4 MiB sample (1024 pages)"


def test_a_task_of_small_samples_then_large_ones_delivers_every_sample():
    # The first sample of each batch is tiny, so the task is gathered without counting bytes;
    # the large ones after it must still arrive whole and in place.
    def growing(info):
        size = 8 if info.idx_in_batch == 0 else (1 << 20) + info.idx_in_batch
        return np.full(size, info.idx_in_epoch % 251, np.uint8)

    with ParallelSource(growing, 6, num_workers=2) as src:
        it = iter(src)
        for b in range(4):
            batch = next(it)
            assert [s.size for s in batch] == [8] + [(1 << 20) + k for k in range(1, 6)]
            for k, sample in enumerate(batch):
                assert (sample == (6 * b + k) % 251).all(), (b, k)


class Misuses:
    """An in-place callback that asks ``buffers.array`` for something wrong at sample 6."""

    def __init__(self, args, kwargs):
        self.args, self.kwargs = args, kwargs

    def __call__(self, info, buffers):
        if info.idx_in_epoch == 6:
            return buffers.array(*self.args, **self.kwargs)
        row = buffers.array(3, np.float32)
        row[:] = info.idx_in_epoch
        return row


@pytest.mark.parametrize("args, kwargs, error, expected", [
    ((3, np.float32), {"output": 1}, SampleError, "expected output 0 (the source has 1 output), got 1"),
    ((3, np.float32), {"output": "images"}, SampleError, "expected output 0 (the source has 1 output), got 'images'"),
    (((3, -1), np.float32), {}, SampleError, "expected a shape of ints >= 0"),
    (("three", np.float32), {}, SampleError, "expected a shape of ints >= 0"),
    ((3, "float99"), {}, SampleError, "expected a NumPy dtype, got 'float99'"),
    (((1 << 30, 1 << 30), np.float64), {}, SharedMemoryError, "more than any machine has"),
    ((1 << 45, np.uint8), {}, SharedMemoryError, "asks for 32768.0 GiB: cannot reserve"),
])
def test_buffers_misuse_names_the_call_the_sample_and_what_was_expected(args, kwargs, error, expected):
    with ParallelSource(Misuses(args, kwargs), 4, num_workers=2, in_place=True) as src:
        with pytest.raises(error) as caught:
            list(src)
    message = caught.value.strerror if isinstance(caught.value, OSError) else str(caught.value)
    assert expected in message, message
    assert message.startswith("buffers.array(") and "idx_in_epoch=6" in message, message
