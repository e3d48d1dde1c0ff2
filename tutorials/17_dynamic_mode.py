"""Tutorial 17: DALI's dynamic mode (``ndd``) with a parallel external source.

In dynamic mode there is no pipeline: each ``ndd`` operator runs when it is
called, on the batches it is given. DALI's own ``ndd.ExternalSource`` polls a
callable *without* parameters in the training process, so reading and
preparing each sample in Python takes that process's time, one sample after
another. The same loop moves to worker processes by changing the import and
the source's arguments:

    import extsrc.dynamic as ndd   # instead of: import nvidia.dali.experimental.dynamic as ndd
    source = ndd.ExternalSource(JpegReader(...), 2, parallel=True, batch_size=8, num_workers=2)

The callback now gets a ``SampleInfo`` (as in tutorial 1) in the workers, and
each call of ``source()`` returns the next batch, one ``ndd.Batch`` per
output, straight from shared memory. ``StopIteration`` ends the epoch; the
next call starts the next one. This script decodes one epoch both ways (DALI's
in-process source, then the parallel one) and checks that the images match.

Run: ``python tutorials/17_dynamic_mode.py [OUT_DIR] [--gpu]``
"""

import os
from importlib.resources import files

import numpy as np
import nvidia.dali.experimental.dynamic as dali_ndd

import extsrc.dynamic as ndd
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


def in_process_source(reader: JpegReader):
    """Before: DALI's ExternalSource, a callable without parameters run in this process."""
    batches = iter(range(0, len(reader.samples), BATCH_SIZE))

    def next_batch():
        start = next(batches)  # StopIteration ends the epoch
        samples = [reader(Info(start + k)) for k in range(BATCH_SIZE)]
        return tuple(dali_ndd.batch([s[j] for s in samples]) for j in range(2))

    return dali_ndd.ExternalSource(next_batch, 2)


class Info:
    """What the in-process version passes its reader (the parallel source passes SampleInfo)."""

    def __init__(self, idx_in_epoch: int):
        self.idx_in_epoch = idx_in_epoch


def decode_epoch(source, device: str):
    """One epoch: decode each batch of JPEGs; the images (as NumPy) and the labels."""
    images, labels = [], []
    while True:
        try:
            jpegs, label_batch = source()
        except StopIteration:
            return images, labels
        decoded = ndd.decoders.image(jpegs, device=device).cpu()
        images += [np.asarray(decoded.select(i)) for i in range(decoded.batch_size)]
        labels += [int(np.asarray(label_batch.select(i))[0]) for i in range(label_batch.batch_size)]


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)
    device = "gpu" if args.gpu else "cpu"
    reader = JpegReader(DATA_DIR)

    before, before_labels = decode_epoch(in_process_source(reader), device)

    # After: the same reader in two worker processes (sample mode, a SampleInfo per call).
    with ndd.ExternalSource(reader, 2, parallel=True, batch_size=BATCH_SIZE, num_workers=2,
                            start_method="spawn") as source:
        images, labels = decode_epoch(source, device)
        print(source.stats())

    assert labels == before_labels and all(np.array_equal(a, b) for a, b in zip(images, before))
    print(f"one epoch: {len(images)} images, the same as DALI's in-process source gives; "
          f"labels {labels[:10]}...")
    tutorial_io.save(args.out, __file__, images, labels)


if __name__ == "__main__":
    main()
