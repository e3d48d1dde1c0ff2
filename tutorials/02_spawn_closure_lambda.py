"""Tutorial 2: closures and lambdas as sources with ``spawn``.

A ``spawn`` worker is a fresh interpreter: it gets the source by pickling.
Python's own pickle stores a function as "module + name" and cannot store a
lambda or a function nested in another one at all. The default pickler of a
pipeline (``py_callback_pickler=None``) goes further: lambdas, closures and
functions defined in the main script travel by value, their code and the
values they captured included. So both sources below work unchanged:

* ``make_reader(...)`` returns a closure over the file list;
* a lambda, written inline, that gives every other sample a horizontal flip.

Everything a closure captures is pickled with it: capture the small things
(paths, a list of names), not open files or big arrays (see tutorial 5).

Two parallel sources in one pipeline share its ``py_num_workers`` workers.

Run: ``python tutorials/02_spawn_closure_lambda.py [OUT_DIR] [--gpu]``
"""

import os
from importlib.resources import files

import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8


def make_reader(data_dir: str):
    """A closure: sample ``i`` of an epoch is (JPEG bytes, label) of the i-th listed file."""
    image_dir = os.path.join(data_dir, "images")
    with open(os.path.join(data_dir, "labels.txt")) as f:
        samples = [(name, int(label)) for name, label in (line.split() for line in f)]

    def read(info):
        if info.idx_in_epoch >= len(samples):
            raise StopIteration
        name, label = samples[info.idx_in_epoch]
        with open(os.path.join(image_dir, name), "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8), np.array([label], dtype=np.int32)

    return read


@pipeline_def(batch_size=BATCH_SIZE, num_threads=2, py_num_workers=2, py_start_method="spawn")
def flip_pipeline(data_dir, decoder_device):
    jpegs, labels = fn.external_source(
        source=make_reader(data_dir), num_outputs=2, batch=False, parallel=True,
        dtype=[types.UINT8, types.INT32],
    )
    flip = fn.external_source(
        source=lambda info: np.array(info.idx_in_epoch % 2, dtype=np.int32),
        batch=False, parallel=True, dtype=types.INT32,
    )
    images = fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB)
    images = fn.flip(images, horizontal=flip)
    return images, labels


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)

    device, device_id = tutorial_io.decoder_device(args)
    pipe = flip_pipeline(DATA_DIR, device, device_id=device_id)
    pipe.build()
    images, labels = [], []
    for _ in range(2):  # two batches are enough to see the flips
        out_images, out_labels = pipe.run()
        tutorial_io.add_batch(images, labels, out_images, out_labels)
    print(f"{len(images)} images, odd ones flipped; labels {labels}")

    tutorial_io.save(args.out, __file__, images, labels)


if __name__ == "__main__":
    main()
