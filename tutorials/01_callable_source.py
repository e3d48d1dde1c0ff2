"""Tutorial 1: a callable object as a parallel source.

With ``parallel=True`` and ``batch=False`` (sample mode) the pipeline never
calls the source in its own thread: worker processes do, one sample at a time,
and hand the pipeline whole batches through shared memory. The pipeline
decides which samples to ask for; the source only answers ``SampleInfo``:

* ``idx_in_epoch``: the position of the sample in the epoch (use this one to
  choose what to load),
* ``idx_in_batch``, ``iteration``: where it lands,
* ``epoch_idx``: which epoch it belongs to (see tutorial 6).

A source that keeps state between calls would break here, because each worker
has its own copy and sees only some of the samples. So the source is a plain
function of ``SampleInfo``: here an object that knows the file list and reads
one JPEG per call. Raising ``StopIteration`` ends the epoch; the pipeline then
raises ``StopIteration`` from ``run()``, and ``reset()`` starts the next one.

The workers are started with ``spawn``, so the source object is pickled and
sent to them; tutorials 2 to 5 are about what that takes.

Run: ``python tutorials/01_callable_source.py [OUT_DIR] [--gpu]``
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
    """Sample ``i`` of an epoch: (encoded bytes of the i-th bundled JPEG, its label)."""

    def __init__(self, data_dir: str):
        self.image_dir = os.path.join(data_dir, "images")
        with open(os.path.join(data_dir, "labels.txt")) as f:
            self.samples = [(name, int(label)) for name, label in (line.split() for line in f)]

    def __call__(self, info):
        if info.idx_in_epoch >= len(self.samples):
            raise StopIteration
        name, label = self.samples[info.idx_in_epoch]
        with open(os.path.join(self.image_dir, name), "rb") as f:
            encoded = np.frombuffer(f.read(), dtype=np.uint8)
        return encoded, np.array([label], dtype=np.int32)


@pipeline_def(batch_size=BATCH_SIZE, num_threads=2, py_num_workers=2, py_start_method="spawn")
def jpeg_pipeline(source, decoder_device):
    jpegs, labels = fn.external_source(
        source=source, num_outputs=2, batch=False, parallel=True, dtype=[types.UINT8, types.INT32]
    )
    images = fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB)
    return images, labels


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)

    device, device_id = tutorial_io.decoder_device(args)
    pipe = jpeg_pipeline(JpegReader(DATA_DIR), device, device_id=device_id)
    pipe.build()
    images, labels = [], []
    try:
        while True:
            out_images, out_labels = pipe.run()
            size = tutorial_io.add_batch(images, labels, out_images, out_labels)
            print(f"batch of {size}: shapes {[b.shape[:2] for b in images[-size:][:3]]}...")
    except StopIteration:
        pipe.reset()
    print(f"one epoch: {len(images)} images, labels {labels[:10]}...")

    tutorial_io.save(args.out, __file__, images, labels)


if __name__ == "__main__":
    main()
