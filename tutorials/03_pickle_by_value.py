"""Tutorial 3: ``pickle_by_value`` for a function the workers cannot import.

A function defined at the top level of an ordinary module is pickled by
reference: ``spawn`` workers receive "module ``readers``, function
``read_sample``" and import ``readers`` themselves. That fails when the module
only exists where the pipeline was built: a helper file next to a notebook, a
module generated or edited at run time, a folder that is on ``sys.path`` in
the main process only.

``pickle_by_value(read_sample)`` marks the function so that the default pickler
sends its code, and the module globals it uses, instead of its name. The
workers then never import ``readers``.

To show it, this script writes ``readers.py`` to a temporary folder, imports
it, and then deletes the file and the ``sys.path`` entry before any worker
starts. Without the ``pickle_by_value`` line the workers fail to start with
``ModuleNotFoundError: No module named 'readers'``.

Run: ``python tutorials/03_pickle_by_value.py [OUT_DIR] [--gpu]``
"""

import importlib
import os
import shutil
import sys
import tempfile
from importlib.resources import files

from nvidia.dali import types

from extsrc import fn, pipeline_def
from extsrc import pickle_by_value

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8

READERS_PY = '''
import os
import numpy as np

DATA_DIR = {data_dir!r}
with open(os.path.join(DATA_DIR, "labels.txt")) as f:
    SAMPLES = [(name, int(label)) for name, label in (line.split() for line in f)]


def read_sample(info):
    if info.idx_in_epoch >= len(SAMPLES):
        raise StopIteration
    name, label = SAMPLES[info.idx_in_epoch]
    with open(os.path.join(DATA_DIR, "images", name), "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8), np.array([label], dtype=np.int32)
'''


def import_vanishing_module(name: str, source: str):
    """Imports ``source`` as module ``name``, then removes its file and its sys.path entry."""
    folder = tempfile.mkdtemp(prefix="extsrc-tutorial-")
    with open(os.path.join(folder, name + ".py"), "w") as f:
        f.write(source)
    sys.path.insert(0, folder)
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(folder)
        shutil.rmtree(folder)
    return module


@pipeline_def(batch_size=BATCH_SIZE, num_threads=2, py_num_workers=2, py_start_method="spawn")
def jpeg_pipeline(source, decoder_device):
    jpegs, labels = fn.external_source(
        source=source, num_outputs=2, batch=False, parallel=True, dtype=[types.UINT8, types.INT32]
    )
    return fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB), labels


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)

    readers = import_vanishing_module("readers", READERS_PY.format(data_dir=DATA_DIR))
    read_sample = pickle_by_value(readers.read_sample)  # or @pickle_by_value in readers.py

    device, device_id = tutorial_io.decoder_device(args)
    pipe = jpeg_pipeline(read_sample, device, device_id=device_id)
    pipe.build()  # the workers start here, after readers.py is gone
    images, labels = [], []
    for _ in range(2):
        out_images, out_labels = pipe.run()
        tutorial_io.add_batch(images, labels, out_images, out_labels)
    print(f"{len(images)} images from a function of a module the workers never imported; "
          f"labels {labels}")

    tutorial_io.save(args.out, __file__, images, labels)


if __name__ == "__main__":
    main()
