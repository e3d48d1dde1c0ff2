"""Tutorial 16: train from objects in an S3 bucket, many requests in flight per worker.

Training data often sits in an object store, where each request waits tens
of milliseconds before its first byte. A source that reads one object at a
time leaves its worker idle while it waits: with 2 workers and 20 ms per
request no loader gets past ~100 samples/s, whatever the bandwidth. Here the
source is an ``async def`` callback reading the bucket with aiobotocore (the
async twin of boto3, same configuration and errors); ``concurrency=32`` lets
each worker keep 32 requests in flight on its own event loop, and every
object is written into the batch's shared memory as soon as it arrives.
Batches still come whole and in order, the same as with ``concurrency=1``.

The bucket is served on this machine by moto's S3-compatible server (in its
own process, on loopback): the script uploads the bundled JPEGs and their
labels with boto3, then trains a small softmax classifier on the decoded
images for a few epochs, reading the bucket through the drop-in. With a real
bucket, drop ``endpoint_url`` and the test credentials.

The statistics at the end tell how many requests were in flight per worker.

Needs ``pip install -e ".[dali,remote]" "moto[server]"``.
Run: ``python tutorials/16_train_from_a_bucket.py [OUT_DIR] [--gpu]``
"""

import os
import sys
from importlib.resources import files

import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BUCKET = "digits"
BATCH_SIZE = 16
EPOCHS = 3
SIDE = 16  # the classifier sees the decoded images downscaled to SIDE x SIDE, gray
LEARNING_RATE = 0.05  # the loss falls epoch after epoch (0.5 overshoots)


def upload(s3, data_dir: str) -> int:
    """Puts every bundled JPEG into the bucket as ``train/NNNNN.jpg``, its label as metadata."""
    s3.create_bucket(Bucket=BUCKET)
    with open(os.path.join(data_dir, "labels.txt")) as f:
        samples = [(name, int(label)) for name, label in (line.split() for line in f)]
    for index, (name, label) in enumerate(samples):
        with open(os.path.join(data_dir, "images", name), "rb") as image:
            s3.put_object(Bucket=BUCKET, Key=f"train/{index:05d}.jpg", Body=image.read(),
                          Metadata={"label": str(label)})
    return len(samples)


class BucketReader:
    """``async def __call__(info)``: the object ``train/<idx>.jpg`` and its label.

    The client is opened once per worker process, on the worker's event loop
    (on first use, after the fork): only the endpoint and credentials are
    pickled or inherited.
    """

    def __init__(self, endpoint_url: str, credentials: dict, records: int):
        self.endpoint_url = endpoint_url
        self.credentials = credentials
        self.records = records
        self.client = None
        self.pid = None

    async def __call__(self, info):
        if info.idx_in_epoch >= self.records:
            raise StopIteration
        if self.pid != os.getpid():
            from aiobotocore.session import get_session

            self.client = await get_session().create_client(
                "s3", endpoint_url=self.endpoint_url, **self.credentials).__aenter__()
            self.pid = os.getpid()
        response = await self.client.get_object(Bucket=BUCKET, Key=f"train/{info.idx_in_epoch:05d}.jpg")
        async with response["Body"] as body:
            encoded = np.frombuffer(await body.read(), dtype=np.uint8)
        label = int(response["Metadata"]["label"])
        return encoded, np.array([label], dtype=np.int32)


@pipeline_def(batch_size=BATCH_SIZE, num_threads=1, py_num_workers=2)
def bucket_pipeline(source, decoder_device):
    jpegs, labels = fn.external_source(source=source, num_outputs=2, batch=False, parallel=True,
                                       dtype=[types.UINT8, types.INT32], concurrency=32)
    return fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB), labels


def features(image: np.ndarray) -> np.ndarray:
    """The image as SIDE x SIDE gray values in [0, 1], by block averaging (no extra package)."""
    gray = image.mean(axis=2)
    h, w = gray.shape
    gray = gray[: h - h % SIDE, : w - w % SIDE]
    blocks = gray.reshape(SIDE, gray.shape[0] // SIDE, SIDE, gray.shape[1] // SIDE).mean(axis=(1, 3))
    return blocks.reshape(-1) / 255.0


def train_step(weights: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """One step of softmax regression on a batch; returns the batch's loss."""
    logits = x @ weights
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    p[np.arange(len(y)), y] -= 1
    weights -= LEARNING_RATE * x.T @ p / len(y)
    return loss


def main(argv=None):
    # The S3 server on loopback is the benchmarks' (benchmarks/ of the checkout, beside tutorials/).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.s3_server import CREDENTIALS, S3Server

    args = tutorial_io.parse_args(__doc__, argv)
    device, device_id = tutorial_io.decoder_device(args)
    with S3Server() as server:
        records = upload(server.client(), DATA_DIR)
        pipe = bucket_pipeline(BucketReader(server.endpoint_url, CREDENTIALS, records), device,
                               device_id=device_id)
        pipe.build()
        weights = np.zeros((SIDE * SIDE + 1, 10))
        images, labels, losses = [], [], []
        try:
            for epoch in range(EPOCHS):
                epoch_images, epoch_labels, epoch_loss = [], [], []
                try:
                    while True:
                        out_images, out_labels = pipe.run()
                        start = len(epoch_images)
                        tutorial_io.add_batch(epoch_images, epoch_labels, out_images, out_labels)
                        x = np.stack([np.append(features(im), 1.0) for im in epoch_images[start:]])
                        y = np.array(epoch_labels[start:])
                        epoch_loss.append(train_step(weights, x, y))
                except StopIteration:
                    pipe.reset()
                losses.append(float(np.mean(epoch_loss)))
                print(f"epoch {epoch}: {len(epoch_images)} images from s3://{BUCKET}, "
                      f"mean loss {losses[-1]:.3f}")
                images, labels = epoch_images, epoch_labels
            (stats,) = pipe.extsrc_stats().values()
            print(stats)
        finally:
            pipe.close()
    tutorial_io.save(args.out, __file__, images, labels, losses=losses)


if __name__ == "__main__":
    main()
