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

import argparse
import os
from importlib.resources import files

import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

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
            out_images = out_images.as_cpu()
            images += [np.array(out_images[i]) for i in range(len(out_images))]
            labels += [int(np.array(out_labels[i])[0]) for i in range(len(out_labels))]
    except StopIteration:
        pipe.reset()
    return images, labels


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("EXTSRC_TUTORIAL_OUT"),
                        help="folder to save the decoded images and labels in (default: "
                             "$EXTSRC_TUTORIAL_OUT; unset: save nothing)")
    parser.add_argument("--gpu", action="store_true", help="decode on GPU 0 (device='mixed')")
    args = parser.parse_args(argv)

    with open(os.path.join(DATA_DIR, "labels.txt")) as f:
        samples = [(name, int(label)) for name, label in (line.split() for line in f)]
    image_dir = os.path.join(DATA_DIR, "images")
    device, device_id = ("mixed", 0) if args.gpu else ("cpu", None)

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

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        images = train_images + val_images
        path = os.path.join(args.out, os.path.splitext(os.path.basename(__file__))[0] + ".npz")
        np.savez(path, labels=np.array(train_labels + val_labels),
                 split=np.array([0] * len(train_labels) + [1] * len(val_labels)),
                 **{f"image_{i:03d}": im for i, im in enumerate(images)})
        print(f"saved {path}")


if __name__ == "__main__":
    main()
