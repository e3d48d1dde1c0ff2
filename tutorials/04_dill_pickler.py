"""Tutorial 4: another pickler, with keyword arguments: ``(dill, {"recurse": True})``.

``py_callback_pickler`` replaces the pickler used to send sources to ``spawn``
workers. It takes any module or object with ``dumps`` and ``loads`` (``dill``,
``cloudpickle``, ``pickle``, your own), or a tuple ``(pickler, dumps_kwargs)``
or ``(pickler, dumps_kwargs, loads_kwargs)`` to pass keyword arguments.

The source here is an instance of a class defined inside a factory function,
whose code uses globals of this script: ``np`` and ``SAMPLES`` (which ``main()``
fills in at run time). DALI's default pickler refuses the local class
("Can't pickle local object"); extsrc's default pickler (cloudpickle) would
take it. ``dill`` takes it too, but only with ``recurse=True`` does it carry the
globals the code uses: with plain ``dill`` the reader reaches the workers and
then fails there with ``NameError: name 'SAMPLES' is not defined``.

Run: ``python tutorials/04_dill_pickler.py [OUT_DIR] [--gpu]``
"""

import os
from importlib.resources import files

import dill
import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8
SAMPLES = []  # (file name, label), filled in by main()


def make_reader(image_dir: str):
    """A reader object of a local class: sample ``i`` is (JPEG bytes, label) of SAMPLES[i]."""

    class Reader:
        def __call__(self, info):
            if info.idx_in_epoch >= len(SAMPLES):
                raise StopIteration
            name, label = SAMPLES[info.idx_in_epoch]
            with open(os.path.join(image_dir, name), "rb") as f:
                return np.frombuffer(f.read(), dtype=np.uint8), np.array([label], dtype=np.int32)

    return Reader()


@pipeline_def(batch_size=BATCH_SIZE, num_threads=2, py_num_workers=2, py_start_method="spawn",
              py_callback_pickler=(dill, {"recurse": True}))
def jpeg_pipeline(source, decoder_device):
    jpegs, labels = fn.external_source(
        source=source, num_outputs=2, batch=False, parallel=True, dtype=[types.UINT8, types.INT32]
    )
    return fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB), labels


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)

    with open(os.path.join(DATA_DIR, "labels.txt")) as f:
        SAMPLES[:] = [(name, int(label)) for name, label in (line.split() for line in f)][:16]

    reader = make_reader(os.path.join(DATA_DIR, "images"))
    device, device_id = tutorial_io.decoder_device(args)
    pipe = jpeg_pipeline(reader, device, device_id=device_id)
    pipe.build()
    images, labels = [], []
    try:
        while True:
            out_images, out_labels = pipe.run()
            tutorial_io.add_batch(images, labels, out_images, out_labels)
    except StopIteration:
        pipe.reset()
    print(f"one epoch of the {len(SAMPLES)} samples main() chose: labels {labels}")

    tutorial_io.save(args.out, __file__, images, labels)


if __name__ == "__main__":
    main()
