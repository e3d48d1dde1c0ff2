"""Zero-copy feeding, and shared memory never reused while DALI or the user may read it.

NVIDIA/DALI#6027: a parallel external source returned directly as a pipeline
output gave garbage once its shared-memory buffer was recycled while the user
still held the output.
"""

from __future__ import annotations


import numpy as np
import pytest

from extsrc import fn, pipeline_def
from extsrc.shm.slots import lease_of
from dali_support import samples_of

CPU = dict(num_threads=1, device_id=None)


class Stamped:
    """Sample ``i`` of epoch ``e``: a dense block and a ragged vector, both filled with a stamp."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, info):
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        stamp = info.epoch_idx * 1000 + info.idx_in_epoch
        return (
            np.full((64,), stamp, dtype=np.int32),
            np.full((1 + info.idx_in_epoch % 5,), stamp, dtype=np.int32),
        )


def _check(outputs, iteration, epoch, batch_size):
    dense, ragged, reshaped = outputs
    for k in range(batch_size):
        stamp = epoch * 1000 + iteration * batch_size + k
        assert (np.array(dense[k]) == stamp).all(), f"dense output of {iteration, epoch} changed"
        assert (np.array(ragged[k]) == stamp).all(), f"ragged output of {iteration, epoch} changed"
        assert (np.array(reshaped[k]) == stamp).all(), f"reshaped output of {iteration, epoch} changed"


def _stamped_pipeline(**kwargs):
    @pipeline_def(batch_size=2, py_num_workers=2, **CPU, **kwargs)
    def pipe():
        dense, ragged = fn.external_source(Stamped(12), num_outputs=2, parallel=True, batch=False)
        # The source's outputs are the pipeline's outputs, directly and through a
        # reshape (which shares its input's memory).
        return dense, ragged, fn.reshape(dense, shape=[8, 8])

    return pipe()


def test_outputs_kept_by_the_user_stay_right():
    kept = []
    with _stamped_pipeline() as p:
        for epoch in range(3):
            iteration = 0
            while True:
                try:
                    kept.append((p.run(), iteration, epoch))
                except StopIteration:
                    p.reset()
                    break
                iteration += 1
        # Every output of three epochs, held without a copy, checked only now:
        # the workers have rewritten every slot many times since.
        assert len(kept) == 18
        for outputs, iteration, epoch in kept:
            _check(outputs, iteration, epoch, 2)
    for outputs, iteration, epoch in kept:  # and after close()
        _check(outputs, iteration, epoch, 2)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_older_executor_outputs_stay_right_until_the_next_run(depth):
    # exec_dynamic=False hands out outputs that point at the fed memory itself;
    # DALI's own rule for that executor: an output is valid until the next run().
    with _stamped_pipeline(exec_dynamic=False, prefetch_queue_depth=depth) as p:
        for epoch in range(2):
            iteration = 0
            while True:
                try:
                    outputs = p.run()
                except StopIteration:
                    p.reset()
                    break
                _check(outputs, iteration, epoch, 2)
                iteration += 1
            assert iteration == 6


def test_batches_reach_dali_without_a_copy(monkeypatch):
    fed = []

    @pipeline_def(batch_size=4, py_num_workers=1, **CPU)
    def pipe():
        return tuple(fn.external_source(Stamped(16), num_outputs=2, parallel=True, batch=False))

    with pipe() as p:
        original = p._feed_input

        def spy(name, data, *args, **kwargs):
            fed.append(data)
            return original(name, data, *args, **kwargs)

        monkeypatch.setattr(p, "_feed_input", spy)
        outputs = [tuple(samples_of(o) for o in p.run()) for _ in range(4)]
        assert outputs[3][0][0][0] == 12
    dense_feeds = [data for data in fed[2:] if isinstance(data, np.ndarray)]
    list_feeds = [data for data in fed if isinstance(data, list)]
    # After the first batch the uniform output arrives as one array...
    assert dense_feeds and all(d.shape == (4, 64) for d in dense_feeds)
    # ... and nothing DALI gets owns its memory: all of it is a view of shared memory.
    for array in dense_feeds + [s for data in list_feeds for s in data]:
        assert not array.flags.owndata
        assert lease_of(array) is not None  # a view of an extsrc batch's shared memory
