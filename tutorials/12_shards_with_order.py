"""Tutorial 12: shards with ``extsrc.Order``: disjoint, equal, and shuffled the same way.

Tutorial 7 slices the file list by hand. ``Order(..., shard=(index, count))``
gives each training process its part of every epoch's order: shard ``k`` takes
every ``count``-th record of the global order from position ``k`` on, as
PyTorch's ``DistributedSampler`` does. All shards share the seed, so they
shuffle the same global order and never overlap.

Equal lengths matter in data-parallel training: a process that runs out of
batches first leaves the others waiting at their next all-reduce. With 64
records on 3 shards, ``remainder="pad"`` gives every shard 22 records (two
records of the epoch's start are read twice), ``"drop"`` would give 21 (one
record left out, a different one every epoch). ``last_batch="pad"`` then fills
the last batch of 8 from the start of the shard's order, so every shard has 3
full batches.

The shards run one after the other here; in training each process builds one
pipeline with ``shard="auto"`` (tutorial 13).

Run: ``python tutorials/12_shards_with_order.py [OUT_DIR] [--gpu]``
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
NUM_SHARDS = 3


class RecordReader:
    """Loads ``info.record``: the encoded JPEG, its label and the record number."""

    def __init__(self, data_dir: str):
        self.image_dir = os.path.join(data_dir, "images")
        with open(os.path.join(data_dir, "labels.txt")) as f:
            self.samples = [(name, int(label)) for name, label in (line.split() for line in f)]

    def __len__(self) -> int:
        return len(self.samples)

    def __call__(self, info):
        name, label = self.samples[info.record]
        with open(os.path.join(self.image_dir, name), "rb") as f:
            encoded = np.frombuffer(f.read(), dtype=np.uint8)
        return encoded, np.array([label], dtype=np.int32), np.array([info.record], dtype=np.int64)


@pipeline_def(batch_size=BATCH_SIZE, num_threads=2, py_num_workers=2)
def jpeg_pipeline(source, order, decoder_device):
    jpegs, labels, records = fn.external_source(
        source=source, num_outputs=3, batch=False, parallel=True, order=order, last_batch="pad",
        dtype=[types.UINT8, types.INT32, types.INT64],
    )
    return fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB), labels, records


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)

    reader = RecordReader(DATA_DIR)
    device, device_id = tutorial_io.decoder_device(args)
    images, labels, shards, records, batches = [], [], [], [], []
    for shard in range(NUM_SHARDS):
        order = extsrc.Order(len(reader), shuffle=True, seed=7, shard=(shard, NUM_SHARDS), remainder="pad")
        pipe = jpeg_pipeline(reader, order, device, device_id=device_id)
        pipe.build()
        shard_labels, count = [], 0
        try:
            while True:
                out_images, out_labels, out_records = pipe.run()
                tutorial_io.add_batch(images, shard_labels, out_images, out_labels)
                records += [int(np.array(out_records[i])[0]) for i in range(len(out_records))]
                count += 1
        except StopIteration:
            pass
        pipe.close()
        print(f"shard {shard} of {NUM_SHARDS}: {len(order)} records, {count} batches, labels {shard_labels}")
        labels += shard_labels
        shards += [shard] * len(shard_labels)
        batches.append(count)

    tutorial_io.save(args.out, __file__, images, labels, shards=shards, records=records, batches=batches)


if __name__ == "__main__":
    main()
