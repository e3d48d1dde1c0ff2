"""Tutorial 14: is the input the bottleneck? Ask the source, then change what it says.

"Is my parallel external source too slow, or is my training step?" is the
question behind most "py_num_workers vs num_threads" threads. extsrc measures
it while the pipeline runs: ``pipe.extsrc_stats()`` gives, for each parallel
source, how long the consumer (DALI) waited for batches, how busy each worker
was, how long the callback takes per sample, how many batches were ready
ahead; ``str()`` of it ends in a diagnosis.

Three runs of the same pipeline:

1. one worker and a callback with a costly augmentation: the consumer waits
   most of the time and the worker is always busy: input-bound, add workers;
2. the same with two workers: the wait shrinks (on a machine with two cores
   or more);
3. a heavy training step after each batch: batches are ready ahead and the
   consumer hardly waits: consumer-bound, the input keeps up.

Run: ``python tutorials/14_find_the_bottleneck.py [OUT_DIR] [--gpu]``
"""

import os
import time
from importlib.resources import files

import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8
RECORDS = 64  # the whole bundled set
AUGMENT_S = 0.01  # the costly augmentation: CPU time per sample in the callback
TRAIN_STEP_S = 0.1  # the heavy training step of run 3, per batch


class AugmentingReader:
    """Reads a JPEG and spends ``AUGMENT_S`` of CPU on it, as a Python augmentation would."""

    def __init__(self, data_dir: str):
        self.image_dir = os.path.join(data_dir, "images")
        with open(os.path.join(data_dir, "labels.txt")) as f:
            self.samples = [(name, int(label)) for name, label in (line.split() for line in f)]

    def __call__(self, info):
        if info.idx_in_epoch >= RECORDS:
            raise StopIteration
        name, label = self.samples[info.idx_in_epoch]
        with open(os.path.join(self.image_dir, name), "rb") as f:
            encoded = np.frombuffer(f.read(), dtype=np.uint8)
        end = time.perf_counter() + AUGMENT_S
        while time.perf_counter() < end:  # stands for the augmentation's work
            pass
        return encoded, np.array([label], dtype=np.int32)


@pipeline_def(batch_size=BATCH_SIZE, num_threads=1)
def jpeg_pipeline(source, decoder_device):
    jpegs, labels = fn.external_source(source=source, num_outputs=2, batch=False, parallel=True,
                                       dtype=[types.UINT8, types.INT32])
    return fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB), labels


def run(workers: int, step_s: float, device, device_id, images, labels):
    """Two epochs with ``workers`` workers and a training step of ``step_s``; the source's stats."""
    pipe = jpeg_pipeline(AugmentingReader(DATA_DIR), device, device_id=device_id,
                         py_num_workers=workers)
    pipe.build()
    try:
        for _ in range(2):
            try:
                while True:
                    out_images, out_labels = pipe.run()
                    tutorial_io.add_batch(images, labels, out_images, out_labels)
                    time.sleep(step_s)  # the training step
            except StopIteration:
                pipe.reset()
        (stats,) = pipe.extsrc_stats().values()  # one parallel source: its statistics
        return stats
    finally:
        pipe.close()


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)
    device, device_id = tutorial_io.decoder_device(args)
    images, labels, input_bound, waits = [], [], [], []
    for title, workers, step_s in (("1 worker", 1, 0.0), ("2 workers", 2, 0.0),
                                   (f"2 workers, a {TRAIN_STEP_S:g} s training step", 2, TRAIN_STEP_S)):
        stats = run(workers, step_s, device, device_id, images, labels)
        print(f"--- {title}\n{stats}\n")
        input_bound.append(stats.input_bound)
        waits.append(stats.steady_wait_fraction)
    tutorial_io.save(args.out, __file__, images[-RECORDS:], labels[-RECORDS:], input_bound=input_bound,
                     waits=waits)


if __name__ == "__main__":
    main()
