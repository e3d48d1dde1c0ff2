"""``import extsrc.dynamic as ndd``: DALI's dynamic mode with a parallel ``ExternalSource``."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest

import extsrc.dynamic as ndd
import nvidia.dali.experimental.dynamic as dali_ndd
from extsrc import Order, SampleInfo
from procs import live_children

EPOCH = 20  # samples per epoch of the sources below


def stamped(info: SampleInfo) -> np.ndarray:
    """A 2x3 sample holding its epoch and index, ``EPOCH`` samples an epoch."""
    if info.idx_in_epoch >= EPOCH:
        raise StopIteration
    return np.array([[info.epoch_idx] * 3, [info.idx_in_epoch] * 3], dtype=np.int32)


def stamped_image(info: SampleInfo) -> np.ndarray:
    """``stamped`` as a 2x3 one-channel image."""
    return stamped(info)[:, :, None]


def by_record(info: SampleInfo) -> np.ndarray:
    """The sample of ``info.record`` (an ``Order``'s shuffled record)."""
    return np.full((2, 3), info.record, dtype=np.int32)


def large(info: SampleInfo) -> np.ndarray:
    return np.full((128, 128, 3), info.idx_in_epoch % 251, dtype=np.uint8)


def ragged(info: SampleInfo) -> np.ndarray:
    if info.idx_in_epoch >= 8:
        raise StopIteration
    return np.full(info.idx_in_epoch + 1, info.idx_in_epoch, dtype=np.uint8)


def fails_on_five(info: SampleInfo) -> np.ndarray:
    if info.idx_in_epoch == 5:
        raise KeyError("record 5 is missing")
    return stamped(info)


def as_numpy(batch) -> list:
    return [np.asarray(batch.select(i)) for i in range(batch.batch_size)]


def epoch_of(es) -> list:
    """Every batch of one epoch of ``es``, called eagerly until ``StopIteration``."""
    batches = []
    while True:
        try:
            batches.append(as_numpy(es()))
        except StopIteration:
            return batches


def in_process(batch_size: int, epoch_idx: int = 0):
    """DALI's own source, fed the same samples as ``stamped`` gives, in this process."""
    infos = iter(range(0, EPOCH, batch_size))

    def next_batch():
        start = next(infos)
        return dali_ndd.batch([stamped(SampleInfo(start + k, k, start // batch_size, epoch_idx))
                               for k in range(batch_size)])

    return dali_ndd.ExternalSource(next_batch)


def test_without_parallel_it_is_dalis_own_class():
    es = ndd.ExternalSource(lambda: np.zeros(3))
    assert type(es) is dali_ndd.ExternalSource
    assert ndd.readers is dali_ndd.readers and ndd.Batch is dali_ndd.Batch


def test_parallel_only_arguments_are_refused_without_parallel():
    with pytest.raises(TypeError, match="batch_size, num_workers apply to a parallel source"):
        ndd.ExternalSource(lambda: np.zeros(3), batch_size=4, num_workers=2)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_eager_calls_give_the_batches_dalis_source_gives(start_method):
    with ndd.ExternalSource(stamped, parallel=True, batch_size=4, num_workers=2,
                            start_method=start_method) as es:
        ours = epoch_of(es)
    theirs = epoch_of(in_process(4))
    assert len(ours) == EPOCH // 4
    for mine, dalis in zip(ours, theirs):
        np.testing.assert_array_equal(mine, dalis)


def test_each_epoch_ends_with_stop_iteration_and_the_next_call_starts_the_next():
    with ndd.ExternalSource(stamped, parallel=True, batch_size=5, num_workers=2) as es:
        first, second = epoch_of(es), epoch_of(es)
    assert [b[0][0, 0] for b in first] == [0] * 4 and [b[0][0, 0] for b in second] == [1] * 4
    assert [b[0][1, 0] for b in second] == [0, 5, 10, 15]


def test_captured_steps_give_the_same_batches_as_eager_calls():
    options = dict(parallel=True, batch_size=4, num_workers=2, layout="HWC")
    with ndd.ExternalSource(stamped_image, **options) as es:
        captured = [as_numpy(ndd.flip(batch, horizontal=1)) for batch in es.captured(4)]
    with ndd.ExternalSource(stamped_image, **options) as es:
        eager = [[np.flip(s, axis=1) for s in b] for b in epoch_of(es)]
    assert len(captured) == EPOCH // 4
    np.testing.assert_array_equal(np.array(captured), np.array(eager))


def test_outputs_take_dalis_dtype_and_layout_and_a_call_checks_the_batch_size():
    two = ndd.ExternalSource(lambda info: (np.zeros((4, 4, 3)), np.zeros(3)), 2, parallel=True,
                             batch_size=2, dtype=[ndd.uint8, ndd.int32], layout=["HWC", ""])
    with two:
        images, labels = two()
        assert (images.dtype, images.layout, labels.dtype) == (ndd.uint8, "HWC", ndd.int32)
        with pytest.raises(ValueError, match="Expected batch size 3, got 2"):
            two(batch_size=3)


def test_a_held_batch_is_shared_memory_and_stays_unchanged_while_later_ones_come():
    with ndd.ExternalSource(large, parallel=True, batch_size=4, num_workers=2, prefetch=2) as es:
        held = [es() for _ in range(8)]
        for _ in range(20):
            es()
        for k, batch in enumerate(held):
            assert [int(np.asarray(batch.select(i))[0, 0, 0]) for i in range(4)] == \
                [(4 * k + i) % 251 for i in range(4)]
        late = held[-1].select(0)
        assert _mapping_of(np.asarray(late).ctypes.data).startswith("/memfd:extsrc")
        del held
        gc.collect()
        assert int(np.asarray(late)[5, 5, 0]) == 28  # a tensor taken from a batch keeps it too


def _mapping_of(address: int) -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) == 6 else ""
    return ""


def test_ragged_samples_come_as_a_batch_of_their_shapes():
    with ndd.ExternalSource(ragged, parallel=True, batch_size=4, num_workers=2) as es:
        batch = es()
        assert [a.tolist() for a in as_numpy(batch)] == [[0], [1, 1], [2, 2, 2], [3, 3, 3, 3]]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_checkpoint_resumes_mid_epoch_exactly(tmp_path, start_method):
    order = Order(40, shuffle=True, seed=7)
    options = dict(parallel=True, batch_size=4, num_workers=2, start_method=start_method, order=order)
    with ndd.ExternalSource(by_record, **options) as es:
        checkpoint = ndd.checkpoint.Checkpoint()
        checkpoint.register(es, "images")
        for _ in range(3):
            es()
        checkpoint.collect()
        pattern = str(tmp_path / "ckpt_{seq}.json")
        checkpoint.save(pattern)
        expected = [as_numpy(es()) for _ in range(5)]  # the rest of epoch 0, then epoch 1
    restored = ndd.checkpoint.Checkpoint()
    restored.load(pattern)
    with ndd.ExternalSource(by_record, **options) as es:
        restored.register(es, "images")
        resumed = [as_numpy(es()) for _ in range(5)]
    np.testing.assert_array_equal(np.array(resumed), np.array(expected))


def test_an_iterable_cycles_as_dalis_cycle_says():
    batches = [[np.full(2, i, np.int16), np.full(2, i, np.int16)] for i in range(3)]
    with ndd.ExternalSource(batches, parallel=True, batch_size=2, cycle="quiet") as es:
        assert [int(np.asarray(es().select(0))[0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with ndd.ExternalSource(batches, parallel=True, batch_size=2, cycle="raise") as es:
        assert len(epoch_of(es)) == 3 and len(epoch_of(es)) == 3
    with ndd.ExternalSource(batches, parallel=True, batch_size=2) as es:
        assert len(epoch_of(es)) == 3
        with pytest.raises(StopIteration):
            es()


def test_a_failing_sample_raises_its_own_error_naming_where_and_the_epoch_goes_on():
    with ndd.ExternalSource(fails_on_five, parallel=True, batch_size=4, num_workers=2) as es:
        es()
        with pytest.raises(KeyError, match="record 5 is missing") as caught:
            es()
        assert "idx_in_epoch=5" in " ".join(caught.value.__notes__)
        assert as_numpy(es())[0][1, 0] == 8


def test_on_error_skip_leaves_the_sample_out_of_full_batches_and_counts_it():
    with ndd.ExternalSource(fails_on_five, parallel=True, batch_size=4, num_workers=2,
                            on_error="skip") as es:
        batches = epoch_of(es)
        # Full batches: those after record 5 are refilled from the next; the 3 samples left at
        # the end make no batch of 4 (last_batch="drop").
        assert [[int(s[1, 0]) for s in b] for b in batches] == [
            [0, 1, 2, 3], [4, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
        assert [(f.idx_in_epoch, f.type_name) for f in es.faults()] == [(5, "KeyError")]


def test_a_callable_without_parameters_is_refused_in_dalis_words():
    with pytest.raises(TypeError, match="must accept exactly one argument"):
        ndd.ExternalSource(lambda: np.zeros(3), parallel=True, batch_size=2)
    with pytest.raises(TypeError, match="needs batch_size="):
        ndd.ExternalSource(stamped, parallel=True)


def test_close_leaves_no_worker_behind():
    before = set(live_children())
    es = ndd.ExternalSource(stamped, parallel=True, batch_size=4, num_workers=2)
    es()
    assert len(set(live_children()) - before) == 2
    es.close()
    assert set(live_children()) - before == set()


def complex_sample(info: SampleInfo) -> np.ndarray:
    return np.array([1 + 2j, 3 + 4j], np.complex64)


def test_a_dtype_dali_has_not_is_refused_rather_than_read_as_another():
    with ndd.ExternalSource(complex_sample, parallel=True, batch_size=2) as es:
        with pytest.raises(TypeError, match="output 0 has samples of dtype complex64"):
            es()


def big_endian_sample(info: SampleInfo) -> np.ndarray:
    return (np.arange(2) + info.idx_in_epoch).astype(">i4")


def test_big_endian_samples_are_refused_rather_than_read_as_other_numbers():
    with ndd.ExternalSource(big_endian_sample, parallel=True, batch_size=2) as es:
        with pytest.raises(TypeError, match=r"output 0 has samples of dtype int32 \(big-endian"):
            es()


def test_threads_calling_at_once_share_one_epoch_each_batch_once():
    import threading

    with ndd.ExternalSource(stamped, parallel=True, batch_size=2, num_workers=2) as es:
        taken, start = [], threading.Barrier(3)

        def loop():
            start.wait()
            taken.extend(epoch_of(es))

        threads = [threading.Thread(target=loop) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    samples = [s for batch in taken for s in batch]
    assert sorted(int(s[1, 0]) for s in samples) == list(range(EPOCH))
    assert {int(s[0, 0]) for s in samples} == {0}  # the first epoch, not one started per thread


def test_a_checkpoint_mid_captured_epoch_is_refused_and_between_epochs_is_exact():
    with ndd.ExternalSource(stamped_image, parallel=True, batch_size=4, layout="HWC") as es:
        for step, batch in enumerate(es.captured(4)):
            ndd.flip(batch, horizontal=1)
            if step == 2:
                with pytest.raises(RuntimeError, match="ahead of the loop"):
                    es.get_state()
        state = json.loads(es.get_state())
    assert (state["epoch_idx"], state["iteration"]) == (1, 0)


def test_a_checkpoint_after_a_skip_resumes_at_the_same_samples():
    def fails_early(info: SampleInfo) -> np.ndarray:
        if info.idx_in_epoch in (1, 2, 3, 5):
            raise OSError(f"record {info.idx_in_epoch} is damaged")
        return stamped(info)

    options = dict(parallel=True, batch_size=4, num_workers=2, on_error="skip")
    with ndd.ExternalSource(fails_early, **options) as es:
        head = [[int(s[1, 0]) for s in as_numpy(es())] for _ in range(2)]
        state = es.get_state()
        rest = [[int(s[1, 0]) for s in b] for b in epoch_of(es)]
    with ndd.ExternalSource(fails_early, **options) as resumed:
        resumed.set_state(state)
        assert [[int(s[1, 0]) for s in b] for b in epoch_of(resumed)] == rest
    assert head == [[0, 4, 6, 7], [8, 9, 10, 11]] and rest == [[12, 13, 14, 15], [16, 17, 18, 19]]


def test_the_module_is_dalis_under_extsrcs_name():
    import extsrc.dynamic.checkpoint as checkpoint

    assert checkpoint is dali_ndd.checkpoint
    assert isinstance(ndd.ExternalSource(lambda: np.zeros(2)), ndd.ExternalSource)
    with pytest.raises(TypeError, match="source"):
        ndd.ExternalSource()


def test_gpu_outputs_go_through_dalis_copy_up_to_the_cuda_call():
    import nvidia.dali.backend as dali_backend

    try:
        gpus = dali_backend.GetCUDADeviceCount()
    except RuntimeError:
        gpus = 0
    with ndd.ExternalSource(large, parallel=True, batch_size=4, device="gpu") as es:
        if gpus == 0:
            # The batch came from the workers and reached DALI's copy to the device: the error
            # is CUDA's, not a refusal of the batch.
            with pytest.raises(RuntimeError, match="CUDA"):
                es()
            return
        batch = es()
        assert batch.device == ndd.Device("gpu")
        host = np.asarray(ndd.as_tensor(batch.cpu()))
        assert host.shape == (4, 128, 128, 3) and [int(host[i, 0, 0, 0]) for i in range(4)] == [0, 1, 2, 3]
