"""DALI's parallel external source tutorial, run as a drop-in: the same batches as DALI.

The tutorial (docs/examples/general/data_loading/parallel_external_source.ipynb
in NVIDIA/DALI) reads JPEG files named in a file list with a callable taking a
``SampleInfo``, ends each epoch after the last full batch, and decodes the
images in a pipeline with ``py_num_workers=4`` and ``py_start_method="spawn"``.
Here the same pipeline is built twice, once from ``nvidia.dali`` and once from
``extsrc`` (only the import differs), on CPU, over the bundled images, for
two epochs with ``reset()``; every image and label must be equal.
"""

import os
import shutil

import nvidia.dali
import numpy as np
import pytest

import extsrc
from dali_support import FileListSource, samples_of

BATCH_SIZE = 4
FILES = 14  # three full batches, two images left over (dropped, as in the tutorial)


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    images = os.path.join(os.path.dirname(extsrc.__file__), "data", "images")
    folder = tmp_path_factory.mktemp("tutorial_images")
    names = sorted(os.listdir(images))[:FILES]
    with open(folder / "file_list.txt", "w") as f:
        for label, name in enumerate(names):
            shutil.copy(os.path.join(images, name), folder / name)
            f.write(f"{name} {label % 5}\n")
    return str(folder)


def run_two_epochs(api, folder):
    @api.pipeline_def(batch_size=BATCH_SIZE, num_threads=2, device_id=None, py_num_workers=4,
                      py_start_method="spawn")
    def parallel_pipeline():
        jpegs, labels = api.fn.external_source(source=FileListSource(folder, BATCH_SIZE), num_outputs=2,
                                               batch=False, parallel=True)
        return api.fn.decoders.image(jpegs, device="cpu"), labels

    pipe = parallel_pipeline()
    pipe.build()
    epochs = []
    for _ in range(2):
        batches = []
        while True:
            try:
                images, labels = pipe.run()
            except StopIteration:
                pipe.reset()
                break
            batches.append((samples_of(images), [int(x[0]) for x in samples_of(labels)]))
        epochs.append(batches)
    if hasattr(pipe, "close"):
        pipe.close()
    return epochs


@pytest.mark.slow
def test_the_tutorial_pipeline_gives_the_same_batches_as_dali(image_folder):
    theirs = run_two_epochs(nvidia.dali, image_folder)
    ours = run_two_epochs(extsrc, image_folder)
    assert [len(epoch) for epoch in ours] == [len(epoch) for epoch in theirs] == [FILES // BATCH_SIZE] * 2
    for epoch_ours, epoch_theirs in zip(ours, theirs):
        for (images_ours, labels_ours), (images_theirs, labels_theirs) in zip(epoch_ours, epoch_theirs):
            assert labels_ours == labels_theirs
            assert len(images_ours) == len(images_theirs) == BATCH_SIZE
            for a, b in zip(images_ours, images_theirs):
                assert a.shape == b.shape and a.ndim == 3
                np.testing.assert_array_equal(a, b)
