"""Tutorial 10 (extsrc only): keep the incomplete last batch with ``last_batch="partial"``.

When the data set size is not a multiple of the batch size, the sample that
raises ``StopIteration`` falls inside a batch. DALI's parallel source drops
that whole batch (NVIDIA/DALI#5199): with 64 images in batches of 12, every
epoch shows 60 of them and the last 4 are never seen. extsrc does the same by
default (``last_batch="drop"``), so that it stays a drop-in, and adds
``last_batch="partial"``: the last batch of the epoch holds the samples that
came before ``StopIteration`` (4 here), and the pipeline runs it with that
smaller batch size.

This script runs one epoch each way and prints the batch sizes. It needs the
extsrc import: DALI's own ``external_source`` has no ``last_batch`` argument.

Run: ``python tutorials/10_partial_last_batch.py [OUT_DIR] [--gpu]``
"""

import os
from importlib.resources import files

import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 12


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
            return np.frombuffer(f.read(), dtype=np.uint8), np.array([label], dtype=np.int32)


@pipeline_def(batch_size=BATCH_SIZE, num_threads=2, py_num_workers=2, py_start_method="spawn")
def jpeg_pipeline(source, decoder_device, last_batch):
    jpegs, labels = fn.external_source(
        source=source, num_outputs=2, batch=False, parallel=True, dtype=[types.UINT8, types.INT32],
        last_batch=last_batch,
    )
    return fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB), labels


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)

    reader = JpegReader(DATA_DIR)
    for last_batch in ("drop", "partial"):
        device, device_id = tutorial_io.decoder_device(args)
        pipe = jpeg_pipeline(reader, device, last_batch, device_id=device_id)
        pipe.build()
        images, labels, sizes = [], [], []
        try:
            while True:
                out_images, out_labels = pipe.run()
                sizes.append(tutorial_io.add_batch(images, labels, out_images, out_labels))
        except StopIteration:
            pipe.reset()
        del pipe
        print(f'last_batch="{last_batch}": batch sizes {sizes}, {len(labels)} of '
              f"{len(reader.samples)} images seen")

    # what last_batch="partial" gave: the whole set
    tutorial_io.save(args.out, __file__, images, labels, batch_sizes=sizes)


if __name__ == "__main__":
    main()
