"""Tutorial 9: shared memory in containers, and the ``--shm-size`` to ask for.

Workers hand batches to the pipeline through shared memory. How much the
pipeline needs depends on the batch: about (batches in flight) x (batch size)
x (bytes per sample). Where that memory lives matters in a container:

* extsrc allocates its buffers with ``memfd_create``. They are not files in
  /dev/shm, so Docker's ``--shm-size`` (64 MB by default) does not limit them;
  they count against the container's memory limit like any other memory.
* DALI's own parallel source (and PyTorch's DataLoader) keep their buffers in
  /dev/shm. In a default container a large batch of large samples fails with
  a bus error or "No space left on device"; ``docker run --shm-size=...``
  (``shm_size:`` in compose) gives /dev/shm more room.

This script prints /dev/shm here, what the settings of this tutorial and of a
larger job need, and the ``--shm-size`` for the peers that use /dev/shm; then
it runs one epoch with those settings. ``python -m extsrc doctor --workers N
--batch-size B --sample-bytes S`` does the same for your settings, and
docker/README.md has the Docker side.

Run: ``python tutorials/09_containers_shm.py [OUT_DIR] [--gpu]``
"""

import os
from importlib.resources import files

import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

import tutorial_io
from extsrc.cli.doctor import needed_bytes
from extsrc.shm.limits import dev_shm_usage, format_bytes, shm_size_advice

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8
WORKERS = 2
SOURCE_PREFETCH = 1  # external_source(prefetch_queue_depth=...), DALI's default
PIPELINE_PREFETCH = 2  # pipeline_def(prefetch_queue_depth=...), DALI's default


def dali_dev_shm_bytes(workers: int, batch_size: int, sample_bytes: int) -> int:
    """Estimated /dev/shm use of one DALI parallel source in sample mode.

    DALI keeps (pipeline prefetch + source prefetch) buffers per worker, each
    at least 1 MiB, and doubles a buffer that is too small for the worker's
    share of a batch: up to twice that share.
    """
    share = -(-batch_size // workers) * sample_bytes
    per_buffer = max(1 << 20, 2 * share)
    return (PIPELINE_PREFETCH + SOURCE_PREFETCH) * workers * per_buffer


def report(label: str, workers: int, batch_size: int, sample_bytes: int) -> None:
    """Prints the shared memory one source with these settings needs, and the advice.

    extsrc keeps ``prefetch`` batches being made (the source's
    prefetch_queue_depth) and holds each batch it gave DALI until DALI is done
    with it (the pipeline's prefetch_queue_depth, plus one).
    """
    extsrc_need = needed_bytes(workers, batch_size, sample_bytes, outputs=1,
                               prefetch=SOURCE_PREFETCH, batches_held=PIPELINE_PREFETCH + 1)
    dali_need = dali_dev_shm_bytes(workers, batch_size, sample_bytes)
    print(f"{label}: {workers} workers, batch {batch_size}, {format_bytes(sample_bytes)} per sample")
    print(f"  extsrc:            about {format_bytes(extsrc_need)} of memfd memory, none of it in /dev/shm")
    print(f"  DALI's own source: about {format_bytes(dali_need)} of /dev/shm: "
          f"docker run {shm_size_advice(dali_need)}")


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


@pipeline_def(batch_size=BATCH_SIZE, num_threads=2, py_num_workers=WORKERS, py_start_method="spawn",
              prefetch_queue_depth=PIPELINE_PREFETCH)
def jpeg_pipeline(source, decoder_device):
    jpegs, labels = fn.external_source(
        source=source, num_outputs=2, batch=False, parallel=True, dtype=[types.UINT8, types.INT32],
        prefetch_queue_depth=SOURCE_PREFETCH,
    )
    return fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB), labels


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)

    usage = dev_shm_usage()
    print("/dev/shm here: " + ("not mounted" if usage is None else
                               f"{format_bytes(usage[0])} in all, {format_bytes(usage[1])} free"))
    reader = JpegReader(DATA_DIR)
    largest = max(os.path.getsize(os.path.join(reader.image_dir, n)) for n, _ in reader.samples)
    report("this tutorial", WORKERS, BATCH_SIZE, largest)
    report("an ImageNet-sized job", 8, 256, 512 << 10)

    device, device_id = tutorial_io.decoder_device(args)
    pipe = jpeg_pipeline(reader, device, device_id=device_id)
    pipe.build()
    images, labels = [], []
    try:
        while True:
            out_images, out_labels = pipe.run()
            tutorial_io.add_batch(images, labels, out_images, out_labels)
    except StopIteration:
        pipe.reset()
    print(f"one epoch with these settings: {len(images)} images")

    tutorial_io.save(args.out, __file__, images, labels)


if __name__ == "__main__":
    main()
