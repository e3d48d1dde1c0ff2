"""Tutorial 7: sharding, so that each training process reads its own part.

In data-parallel training every process (usually one per GPU) runs its own
pipeline and must see a different part of the data set. DALI's readers take
``shard_id`` and ``num_shards`` for that; with an external source the source
does it: shard ``k`` of ``n`` owns a contiguous slice of the file list, and
``idx_in_epoch`` counts samples within that slice. The epoch of each shard ends
when its slice is used up.

The shards here run one after the other in one process to keep the script
short; in training, each process builds one pipeline with its rank as
``shard_id`` and the world size as ``num_shards``. To shuffle as well, permute
the whole list with a seed that all shards share (tutorial 6) and slice the
permutation.

Run: ``python tutorials/07_sharding.py [OUT_DIR] [--gpu]``
"""

import os
from importlib.resources import files

import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8
NUM_SHARDS = 2


class ShardReader:
    """Sample ``i`` of an epoch of shard ``shard_id``: the i-th file of that shard's slice."""

    def __init__(self, data_dir: str, shard_id: int, num_shards: int):
        self.image_dir = os.path.join(data_dir, "images")
        with open(os.path.join(data_dir, "labels.txt")) as f:
            samples = [(name, int(label)) for name, label in (line.split() for line in f)]
        begin = len(samples) * shard_id // num_shards
        end = len(samples) * (shard_id + 1) // num_shards
        self.samples = samples[begin:end]

    def __call__(self, info):
        if info.idx_in_epoch >= len(self.samples):
            raise StopIteration
        name, label = self.samples[info.idx_in_epoch]
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

    images, labels, shards = [], [], []
    for shard_id in range(NUM_SHARDS):
        reader = ShardReader(DATA_DIR, shard_id, NUM_SHARDS)
        device, device_id = tutorial_io.decoder_device(args)
        pipe = jpeg_pipeline(reader, device, device_id=device_id)
        pipe.build()
        shard_labels = []
        try:
            while True:
                out_images, out_labels = pipe.run()
                tutorial_io.add_batch(images, shard_labels, out_images, out_labels)
        except StopIteration:
            pipe.reset()
        del pipe  # stops this shard's workers
        print(f"shard {shard_id}/{NUM_SHARDS}: {len(shard_labels)} samples, labels {shard_labels}")
        labels += shard_labels
        shards += [shard_id] * len(shard_labels)

    tutorial_io.save(args.out, __file__, images, labels, shards=shards)


if __name__ == "__main__":
    main()
