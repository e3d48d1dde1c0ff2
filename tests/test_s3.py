"""A bucket on an S3-compatible server (moto), read through boto3 on threads and aiobotocore
on the worker's event loop: the same batches, and a missing key names its sample."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("boto3")
pytest.importorskip("aiobotocore")
pytest.importorskip("moto")

from extsrc import Order, ParallelSource  # noqa: E402
from benchmarks.s3_server import CREDENTIALS, S3Server  # noqa: E402

BUCKET, RECORDS, BATCH = "shards", 40, 8


def key(record: int) -> str:
    return f"train/{record:05d}.bin"


def content(record: int) -> bytes:
    return np.random.default_rng(record).integers(0, 256, 500 + record % 7, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        for record in range(RECORDS):
            client.put_object(Bucket=BUCKET, Key=key(record), Body=content(record))
        yield server


class Boto3Objects:
    """Blocking: one boto3 client per worker process (boto3 clients may be shared by threads)."""

    def __init__(self, endpoint_url: str, missing: int = -1):
        self.endpoint_url = endpoint_url
        self.missing = missing
        self.pid = None

    def __call__(self, info):
        if self.pid != os.getpid():
            import boto3

            self.client = boto3.client("s3", endpoint_url=self.endpoint_url, **CREDENTIALS)
            self.pid = os.getpid()
        name = "no/such/key" if info.record == self.missing else key(info.record)
        body = self.client.get_object(Bucket=BUCKET, Key=name)["Body"].read()
        return np.frombuffer(body, np.uint8)


class AioObjects:
    """async: one aiobotocore client per worker, opened on the worker's event loop."""

    def __init__(self, endpoint_url: str):
        self.endpoint_url = endpoint_url
        self.pid = None

    async def __call__(self, info):
        if self.pid != os.getpid():
            from aiobotocore.session import get_session

            self.client = await get_session().create_client(
                "s3", endpoint_url=self.endpoint_url, **CREDENTIALS).__aenter__()
            self.pid = os.getpid()
        response = await self.client.get_object(Bucket=BUCKET, Key=key(info.record))
        async with response["Body"] as stream:
            body = await stream.read()
        return np.frombuffer(body, np.uint8)


def epoch(callback, concurrency):
    order = Order(RECORDS, shuffle=True, seed=1)
    with ParallelSource(callback, BATCH, num_workers=2, concurrency=concurrency, order=order) as source:
        return [[bytes(s) for s in batch] for batch in source], list(order.epoch(0))


@pytest.mark.slow
def test_a_bucket_read_through_boto3_and_aiobotocore_gives_the_same_batches(s3):
    reference, records = epoch(Boto3Objects(s3.endpoint_url), 1)
    assert [s for b in reference for s in b] == [content(r) for r in records]
    assert epoch(Boto3Objects(s3.endpoint_url), 8)[0] == reference
    assert epoch(AioObjects(s3.endpoint_url), 16)[0] == reference


def test_a_missing_key_names_its_sample(s3):
    with ParallelSource(Boto3Objects(s3.endpoint_url, missing=13), BATCH, num_workers=2,
                        concurrency=8, order=Order(RECORDS)) as source:
        with pytest.raises(Exception, match="NoSuchKey") as caught:
            for _ in source:
                pass
    assert "idx_in_epoch=13," in str(caught.value.__cause__)
