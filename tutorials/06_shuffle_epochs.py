"""Tutorial 6: a new order every epoch, from ``SampleInfo.epoch_idx``.

A parallel source cannot shuffle by keeping state ("the next sample is ..."):
each worker has its own copy of it and sees only some of the samples. It can
compute the order instead. ``idx_in_epoch`` says which position of the epoch is
asked for and ``epoch_idx`` which epoch, so a permutation drawn from a
generator seeded with ``(seed, epoch_idx)`` gives every worker the same order
for an epoch and a different order for the next one, and a rerun with the same
seed gives the same batches.

Computing a permutation costs little next to reading a file, but the reader
keeps the last one, keyed by epoch, so that each worker draws it once.

Run: ``python tutorials/06_shuffle_epochs.py [OUT_DIR] [--gpu]``
"""

import os
from importlib.resources import files

import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8
EPOCHS = 2


class ShuffledReader:
    """Sample ``i`` of epoch ``e``: the file at position i of a permutation seeded with (seed, e)."""

    def __init__(self, data_dir: str, seed: int, limit: int = 24):
        self.image_dir = os.path.join(data_dir, "images")
        with open(os.path.join(data_dir, "labels.txt")) as f:
            samples = [(name, int(label)) for name, label in (line.split() for line in f)]
        self.samples = samples[:limit]  # a short epoch keeps the tutorial quick
        self.seed = seed
        self._order = (None, None)  # (epoch_idx, permutation)

    def order(self, epoch_idx: int) -> np.ndarray:
        if self._order[0] != epoch_idx:
            rng = np.random.default_rng((self.seed, epoch_idx))
            self._order = (epoch_idx, rng.permutation(len(self.samples)))
        return self._order[1]

    def __call__(self, info):
        if info.idx_in_epoch >= len(self.samples):
            raise StopIteration
        name, label = self.samples[self.order(info.epoch_idx)[info.idx_in_epoch]]
        with open(os.path.join(self.image_dir, name), "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8), np.array([label], dtype=np.int32)


@pipeline_def(batch_size=BATCH_SIZE, num_threads=2, py_num_workers=2, py_start_method="spawn")
def jpeg_pipeline(source, decoder_device):
    jpegs, labels = fn.external_source(
        source=source, num_outputs=2, batch=False, parallel=True, dtype=[types.UINT8, types.INT32]
    )
    return fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB), labels


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)

    reader = ShuffledReader(DATA_DIR, seed=42)
    device, device_id = tutorial_io.decoder_device(args)
    pipe = jpeg_pipeline(reader, device, device_id=device_id)
    pipe.build()
    images, labels, epochs = [], [], []
    for epoch in range(EPOCHS):
        epoch_labels = []
        try:
            while True:
                out_images, out_labels = pipe.run()
                tutorial_io.add_batch(images, epoch_labels, out_images, out_labels)
        except StopIteration:
            pipe.reset()
        print(f"epoch {epoch}: labels {epoch_labels}")
        labels += epoch_labels
        epochs += [epoch] * len(epoch_labels)

    tutorial_io.save(args.out, __file__, images, labels, epochs=epochs)


if __name__ == "__main__":
    main()
