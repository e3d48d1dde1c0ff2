"""Batches stay right for as long as they are held, and memory follows what is held."""

import collections
import gc
import resource
import time
from typing import List, Set

import numpy as np
import pytest

from extsrc import ParallelSource

from sources import StopsAt, two_outputs


def first_values(batches):
    return [int(b[0][0]) for b in batches]


def test_list_of_an_epoch_keeps_every_batch_right():
    def f(i):
        if i.idx_in_epoch >= 40:
            raise StopIteration
        return np.full(2, i.idx_in_epoch)

    with ParallelSource(f, batch_size=4) as s:
        batches = list(s)
    assert first_values(batches) == list(range(0, 40, 4))  # still right after close()
    assert [b.as_array()[:, 1].tolist() for b in batches] == [list(range(k, k + 4)) for k in range(0, 40, 4)]


@pytest.mark.parametrize("workers", [1, 2])
def test_batches_kept_from_earlier_epochs_stay_right(workers):
    with ParallelSource(StopsAt(48), 4, num_workers=workers) as src:
        epochs = [list(src) for _ in range(3)]
        for epoch_idx, epoch in enumerate(epochs):
            assert [[int(s[0]) for s in b] for b in epoch] == [[k, k + 1, k + 2, k + 3] for k in range(0, 48, 4)]
            assert [int(b[0][3]) for b in epoch] == [epoch_idx] * 12


def test_kept_batches_with_dense_and_ragged_outputs_stay_right():
    with ParallelSource(two_outputs, 5, num_outputs=2, num_workers=2) as src:
        it = iter(src)
        kept = [next(it) for _ in range(12)]
        for i, (images, ragged) in enumerate(kept):
            assert images.as_array()[:, 0, 0].tolist() == list(range(5 * i, 5 * i + 5))
            assert [r.tolist() for r in ragged] == [list(range(k + 1)) for k in range(5)]


def test_kept_batches_of_a_batch_mode_source_stay_right():
    def batch(iteration):
        if iteration == 20:
            raise StopIteration
        return np.full((3, 2), iteration, np.int32)

    with ParallelSource(batch, 3, batch=True, num_workers=2) as src:
        kept = list(src)
    assert [int(b.as_array()[2, 1]) for b in kept] == list(range(20))


def test_a_slice_or_one_sample_keeps_its_memory_after_the_batch_is_dropped():
    with ParallelSource(StopsAt(10_000), 4, num_workers=2) as src:
        it = iter(src)
        rows, samples = [], []
        for _ in range(10):
            batch = next(it)
            rows.append(batch.as_array()[1:3])  # a view of a view
            samples.append(batch[3])
            del batch
        for _ in range(30):  # memory of dropped batches is reused meanwhile
            next(it)
        assert [r[:, 0].tolist() for r in rows] == [[4 * i + 1, 4 * i + 2] for i in range(10)]
        assert [int(s[0]) for s in samples] == [4 * i + 3 for i in range(10)]


def test_torch_tensors_made_from_batches_keep_their_memory():
    torch = pytest.importorskip("torch")
    with ParallelSource(StopsAt(10_000), 8, num_workers=2) as src:
        it = iter(src)
        tensors = [torch.from_numpy(next(it).as_array()) for _ in range(20)]
        for _ in range(20):
            next(it)
        assert [int(t[0, 0]) for t in tensors] == list(range(0, 160, 8))


def _extsrc_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum("extsrc:" in line for line in maps)


def test_a_loop_that_keeps_nothing_runs_in_the_same_memory_and_mappings():
    def sample(info):
        return np.full((64 << 10,), info.idx_in_epoch % 256, np.uint8)

    batch_bytes = 16 * (64 << 10)
    with ParallelSource(sample, 16, num_workers=2) as src:
        it = iter(src)
        for _ in range(50):
            next(it)
        mappings = _extsrc_mappings()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for i in range(300):
            batch = next(it)
            assert int(batch[0][0]) == (50 + i) * 16 % 256
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        assert src.shared_memory_bytes() <= (src.prefetch + src.batches_held) * batch_bytes
        # At most a few slots more (on a loaded machine the pool's thread may see a dropped
        # batch late, and a new slot is made rather than waiting), not one per batch.
        new_mappings = _extsrc_mappings() - mappings
        assert new_mappings <= 4, f"{new_mappings} new mappings in 300 batches"
    # 300 batches of 1 MiB: far fewer faults than one per page of a batch (256), besides the
    # pages of the few new slots
    assert faults - new_mappings * batch_bytes // 4096 < 300, f"{faults} page faults in 300 batches"


def _extsrc_mapping_names() -> Set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split(None, 5)[-1] for line in maps if "extsrc:" in line}


def _epochs_hold_their_memory(src: ParallelSource, expected: List[int], epochs: int = 12) -> None:
    """Runs ``epochs`` epochs of ``src`` as a training loop that holds ``batches_held`` batches
    while it works (as the option counts them: the one it took and those before), and checks
    that each epoch gives ``expected`` and that no shared memory was mapped past the first."""
    held: collections.deque = collections.deque(maxlen=src.batches_held - 1)
    for _ in range(3):
        held.extend(src)
    seen = _extsrc_mapping_names()
    before = len(seen)
    for _ in range(epochs):
        records = []
        for batch in src:
            time.sleep(0.002)  # a training step, the batches before still held: workers run ahead
            held.append(batch)  # and the oldest is let go
            seen |= _extsrc_mapping_names()
            assert all(int(s.min()) == int(s.max()) for s in batch)
            records += [int(s[0]) for s in batch]
        assert records == expected
    assert len(seen) - before <= 2, \
        f"{len(seen) - before} new shared memory mappings in {epochs} epochs"


def test_skipped_samples_make_no_new_memory_per_batch():
    # on_error="skip" refills each batch from the next workers' batch, which the source
    # holds meanwhile: one slot more, not a new one per batch (DALI's prefetch depth of 2:
    # batches are dispatched as soon as one is taken).
    def sample(info):
        if info.idx_in_epoch >= 256:
            raise StopIteration
        if info.idx_in_epoch % 97 == 96:
            raise OSError(f"record {info.idx_in_epoch} is corrupt")
        return np.full((16 << 10,), info.idx_in_epoch, np.int32)

    with ParallelSource(sample, 8, num_workers=2, on_error="skip", last_batch="partial",
                        batches_held=4, prefetch=2) as src:
        _epochs_hold_their_memory(src, [r for r in range(256) if r % 97 != 96])


def test_an_epoch_end_found_late_makes_no_new_memory_at_the_turnover():
    # The batches made past the end drain while the next epoch's are made: they must not
    # take the place of the batches the loop holds (new memory at every epoch's turnover).
    def sample(info):
        if info.idx_in_epoch >= 256:
            time.sleep(0.02)  # storage that takes a while to say the data ended
            raise StopIteration
        return np.full((16 << 10,), info.idx_in_epoch, np.int32)

    with ParallelSource(sample, 8, num_workers=2, last_batch="partial", batches_held=4) as src:
        _epochs_hold_their_memory(src, list(range(256)))


def test_holding_batches_costs_their_memory_and_dropping_them_gives_it_back():
    def sample(info):
        return np.full((1 << 20,), info.idx_in_epoch % 256, np.uint8)

    with ParallelSource(sample, 8, num_workers=2) as src:  # 8 MiB batches
        it = iter(src)
        for _ in range(10):
            next(it)
        steady = src.shared_memory_bytes()
        held = [next(it) for _ in range(12)]
        holding = src.shared_memory_bytes()
        assert holding >= 12 * (8 << 20) > steady  # a batch of memory per held batch
        assert [int(b[0][0]) for b in held] == [(10 + i) * 8 % 256 for i in range(12)]
        del held
        for _ in range(5):
            next(it)
        # back to what is kept ready (prefetch + batches_held batches), as soon as the pool's
        # thread has seen the batches go (it looks at least every RETURN_POLL_S)
        kept = (src.prefetch + src.batches_held) * (8 << 20)
        deadline = time.monotonic() + 5
        while src.shared_memory_bytes() > kept and time.monotonic() < deadline:
            time.sleep(0.01)
        assert src.shared_memory_bytes() <= kept


def test_close_frees_shared_memory_without_the_garbage_collector():
    def sample(info):
        return np.full((1 << 20,), 1, np.uint8)

    before = _extsrc_mappings()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(5):
            src = ParallelSource(sample, 8, num_workers=2)
            it = iter(src)
            for _ in range(3):
                next(it)
            assert _extsrc_mappings() > before
            src.close()
            assert _extsrc_mappings() == before
    finally:
        if was_enabled:
            gc.enable()


def test_a_batch_held_after_close_stays_right_then_its_memory_goes():
    def sample(info):
        return np.full((1 << 16,), info.idx_in_epoch % 256, np.uint8)

    before = _extsrc_mappings()
    src = ParallelSource(sample, 4, num_workers=2)
    it = iter(src)
    kept = [next(it) for _ in range(3)]
    src.close()
    assert [int(b[1][0]) for b in kept] == [1, 5, 9]
    assert _extsrc_mappings() > before
    del kept, it
    assert _extsrc_mappings() == before


def test_shared_memory_bytes_counts_batches_held_after_close_until_they_are_dropped():
    def sample(info):
        return np.full((1 << 20,), info.idx_in_epoch % 256, np.uint8)

    src = ParallelSource(sample, 4, num_workers=2)  # 4 MiB batches
    it = iter(src)
    for _ in range(4):
        next(it)  # the first batches (one per worker) are copies, made before the layout is known
    kept = [next(it) for _ in range(3)]
    src.close()
    # What a memory check reads: the three held batches still take their memory.
    assert src.shared_memory_bytes() >= 3 * (4 << 20)
    assert src.shared_memory_capacities() == []  # the source holds no slot any more
    kept.pop()
    assert 2 * (4 << 20) <= src.shared_memory_bytes() < 3 * (4 << 20)
    del kept, it
    assert src.shared_memory_bytes() == 0
