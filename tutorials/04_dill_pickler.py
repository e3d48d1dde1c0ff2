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

import argparse
import os
from importlib.resources import files

import dill
import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("EXTSRC_TUTORIAL_OUT"),
                        help="folder to save the decoded images and labels in (default: "
                             "$EXTSRC_TUTORIAL_OUT; unset: save nothing)")
    parser.add_argument("--gpu", action="store_true", help="decode on GPU 0 (device='mixed')")
    args = parser.parse_args(argv)

    with open(os.path.join(DATA_DIR, "labels.txt")) as f:
        SAMPLES[:] = [(name, int(label)) for name, label in (line.split() for line in f)][:16]

    reader = make_reader(os.path.join(DATA_DIR, "images"))
    pipe = jpeg_pipeline(reader, "mixed" if args.gpu else "cpu", device_id=0 if args.gpu else None)
    pipe.build()
    images, labels = [], []
    try:
        while True:
            out_images, out_labels = pipe.run()
            out_images = out_images.as_cpu()
            images += [np.array(out_images[i]) for i in range(len(out_images))]
            labels += [int(np.array(out_labels[i])[0]) for i in range(len(out_labels))]
    except StopIteration:
        pipe.reset()
    print(f"one epoch of the {len(SAMPLES)} samples main() chose: labels {labels}")

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, os.path.splitext(os.path.basename(__file__))[0] + ".npz")
        np.savez(path, labels=np.array(labels), **{f"image_{i:03d}": im for i, im in enumerate(images)})
        print(f"saved {path}")


if __name__ == "__main__":
    main()
