"""Tutorial 11: shuffling with ``extsrc.Order`` instead of a hand-written permutation.

Tutorial 6 computes a permutation per epoch in every worker. ``extsrc.Order``
does that for any callback: ``order=Order(num_records, shuffle=True, seed=...)``
gives each ``SampleInfo`` the ``record`` to load, a different order every
epoch, the same for the same seed, and ends the epoch after the last record, so
the callback needs no ``StopIteration``. Nothing is materialised: the order is a
keyed bijection evaluated per position, as cheap for 10**12 records as for 24.

``SampleInfo.rng`` is a NumPy generator seeded from the seed, the epoch and the
record: here it decides which images are flipped, so a rerun, or a resumed
run, flips the same images, whatever the number of workers.

Run: ``python tutorials/11_shuffle_with_order.py [OUT_DIR] [--gpu]``
"""

import os
from importlib.resources import files

import numpy as np
from nvidia.dali import types

import extsrc
from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8
EPOCHS = 2
RECORDS = 24  # a short epoch keeps the tutorial quick


class RecordReader:
    """Loads ``info.record``; flips it when the record's generator says so."""

    def __init__(self, data_dir: str):
        self.image_dir = os.path.join(data_dir, "images")
        with open(os.path.join(data_dir, "labels.txt")) as f:
            self.samples = [(name, int(label)) for name, label in (line.split() for line in f)]

    def __call__(self, info):
        name, label = self.samples[info.record]
        with open(os.path.join(self.image_dir, name), "rb") as f:
            encoded = np.frombuffer(f.read(), dtype=np.uint8)
        flip = np.array([info.rng.random() < 0.5], dtype=np.int32)  # an augmentation's draw
        return encoded, np.array([label], dtype=np.int32), flip


@pipeline_def(batch_size=BATCH_SIZE, num_threads=2, py_num_workers=2, py_start_method="spawn")
def jpeg_pipeline(source, order, decoder_device):
    jpegs, labels, flips = fn.external_source(
        source=source, num_outputs=3, batch=False, parallel=True, order=order,
        dtype=[types.UINT8, types.INT32, types.INT32],
    )
    images = fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB)
    return fn.flip(images, horizontal=fn.cast(flips, dtype=types.INT32)[0]), labels, flips


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)

    order = extsrc.Order(RECORDS, shuffle=True, seed=42)
    device, device_id = tutorial_io.decoder_device(args)
    pipe = jpeg_pipeline(RecordReader(DATA_DIR), order, device, device_id=device_id)
    pipe.build()
    images, labels, epochs, flips = [], [], [], []
    for epoch in range(EPOCHS):
        epoch_labels = []
        try:
            while True:
                out_images, out_labels, out_flips = pipe.run()
                tutorial_io.add_batch(images, epoch_labels, out_images, out_labels)
                flips += [int(np.array(out_flips[i])[0]) for i in range(len(out_flips))]
        except StopIteration:
            pipe.reset()
        print(f"epoch {epoch}: records {list(order.epoch(epoch))}")
        print(f"         labels  {epoch_labels}")
        labels += epoch_labels
        epochs += [epoch] * len(epoch_labels)
    pipe.close()

    records = [r for epoch in range(EPOCHS) for r in order.epoch(epoch)]
    tutorial_io.save(args.out, __file__, images, labels, epochs=epochs, records=records, flips=flips)


if __name__ == "__main__":
    main()
