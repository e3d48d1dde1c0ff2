"""The DALI drop-in with ``py_backend="ray"``: the same pipeline code, its sources on Ray actors."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("nvidia.dali")

from nvidia.dali import types  # noqa: E402

from extsrc import fn, pipeline_def  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("local_ray")]

CPU = dict(num_threads=1, device_id=None)


class ImageAndLabel:
    """Two outputs: an HWC uint8 image whose height varies with the sample, and an int32 label."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, info):
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        i = info.idx_in_epoch
        return np.full((2 + i % 3, 3, 3), i, np.uint8), np.array([i * 10 + info.epoch_idx], np.int32)


@pipeline_def(batch_size=4, py_num_workers=2, enable_checkpointing=True, **CPU)
def images(source):
    image, label = fn.external_source(source, num_outputs=2, parallel=True, batch=False, last_batch="partial",
                                      dtype=[types.UINT8, types.INT32])
    return fn.flip(image, horizontal=1), label


def run_epochs(pipe, epochs=1):
    out = []
    for e in range(epochs):
        if e:
            pipe.reset()
        while True:
            try:
                outputs = pipe.run()
            except StopIteration:
                break
            out.append([[np.array(o[i]).tolist() for i in range(len(o))] for o in outputs])
    return out


def test_the_same_pipeline_on_ray_actors_gives_what_it_gives_on_processes():
    with images(ImageAndLabel(14), py_backend="ray") as on_ray:  # given at the call, as DALI allows
        assert on_ray.py_backend == "ray" and on_ray.extsrc_pool.backend == "ray"
        ours = run_epochs(on_ray, 2)
    with images(ImageAndLabel(14)) as on_processes:
        theirs = run_epochs(on_processes, 2)
    assert ours == theirs
    assert [len(it[1]) for it in ours] == [4, 4, 4, 2] * 2  # the partial last batch of each epoch


def test_checkpoint_resumes_a_ray_pipeline_exactly():
    with images(ImageAndLabel(14), py_backend="ray") as p:
        p.run()
        saved = p.checkpoint()
        expected = run_epochs(p, 2)
    with images(ImageAndLabel(14), py_backend="ray", checkpoint=saved) as restored:
        assert run_epochs(restored, 2) == expected
    assert expected[0][1] == [[40], [50], [60], [70]]  # resumed at batch 1


@pytest.mark.parametrize("kwargs, message", [
    ({"py_backend": "ray", "py_start_method": "spawn"}, "py_start_method='spawn' chooses how worker"),
    ({"py_ray_options": {"num_cpus": 1}}, "py_ray_options is for py_backend='ray'"),
    ({"py_backend": "threads"}, "py_backend must be one of"),
    ({"py_backend": "ray", "py_ray_options": {"max_restarts": 3}}, "extsrc sets this Ray option"),
])
def test_bad_backend_arguments_are_refused_with_what_was_expected(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", "\\(")):
        images(ImageAndLabel(4), **kwargs)
