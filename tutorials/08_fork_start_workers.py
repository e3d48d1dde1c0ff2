"""Tutorial 8: ``fork`` workers, started with ``pipe.start_py_workers()``.

With ``py_start_method="fork"`` the workers are copies of the main process, made
when they start: nothing is pickled, so any source works (local classes,
lambdas, objects holding whatever they like), and starting is fast. The catch
is CUDA: a process that forks after it has used the GPU gives its children a
CUDA context they cannot use. So the workers must start before the process
touches the GPU, and ``build()`` of a pipeline with GPU operators does.

The order is therefore:

1. define every pipeline that has a parallel source (do not build yet);
2. call ``start_py_workers()`` on each of them;
3. then build them, and only then use the GPU (DALI, PyTorch, CuPy, ...).

Building without step 2 also starts the workers, which is fine for one
pipeline on the CPU, but with two pipelines the second would fork after the
first one's ``build()`` had initialised CUDA. extsrc refuses to fork once CUDA is
initialised and says so, instead of letting the workers crash later.

Here a training pipeline reads the first 48 images and a validation pipeline
the last 16, each with its own workers.

Run: ``python tutorials/08_fork_start_workers.py [OUT_DIR] [--gpu]``
"""

import os
from importlib.resources import files

import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8


class JpegReader:
    """Sample ``i`` of an epoch: (JPEG bytes, label) of the i-th of ``samples``."""

    def __init__(self, image_dir: str, samples):
        self.image_dir = image_dir
        self.samples = samples

    def __call__(self, info):
        if info.idx_in_epoch >= len(self.samples):
            raise StopIteration
        name, label = self.samples[info.idx_in_epoch]
        with open(os.path.join(self.image_dir, name), "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8), np.array([label], dtype=np.int32)


@pipeline_def(batch_size=BATCH_SIZE, num_threads=2, py_num_workers=2, py_start_method="fork")
def jpeg_pipeline(source, decoder_device):
    jpegs, labels = fn.external_source(
        source=source, num_outputs=2, batch=False, parallel=True, dtype=[types.UINT8, types.INT32]
    )
    return fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB), labels


def run_epoch(pipe):
    """(images, labels) of one epoch of ``pipe``."""
    images, labels = [], []
    try:
        while True:
            out_images, out_labels = pipe.run()
            tutorial_io.add_batch(images, labels, out_images, out_labels)
    except StopIteration:
        pipe.reset()
    return images, labels


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)

    with open(os.path.join(DATA_DIR, "labels.txt")) as f:
        samples = [(name, int(label)) for name, label in (line.split() for line in f)]
    image_dir = os.path.join(DATA_DIR, "images")
    device, device_id = tutorial_io.decoder_device(args)

    # 1. define, 2. start the workers of every pipeline, 3. build
    train = jpeg_pipeline(JpegReader(image_dir, samples[:48]), device, device_id=device_id)
    val = jpeg_pipeline(JpegReader(image_dir, samples[48:]), device, device_id=device_id)
    train.start_py_workers()
    val.start_py_workers()
    train.build()
    val.build()

    train_images, train_labels = run_epoch(train)
    val_images, val_labels = run_epoch(val)
    print(f"train: {len(train_labels)} samples, labels {train_labels}")
    print(f"val: {len(val_labels)} samples, labels {val_labels}")

    tutorial_io.save(args.out, __file__, train_images + val_images, train_labels + val_labels,
                     split=[0] * len(train_labels) + [1] * len(val_labels))


if __name__ == "__main__":
    main()
