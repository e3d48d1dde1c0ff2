"""The drop-in with sources that wait on storage: fn.external_source(source=async_fn, concurrency=N)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from extsrc import fn, pipeline_def  # noqa: E402
from benchmarks.object_server import ObjectServer, object_bytes  # noqa: E402
from benchmarks.remote_clients import AsyncHttpObjects, BlockingHttpObjects  # noqa: E402
from dali_support import run_epoch  # noqa: E402

CPU = dict(num_threads=1, device_id=None)
SIZE, RECORDS, BATCH = 2000, 70, 8


@pytest.fixture(scope="module")
def server():
    with ObjectServer(size=SIZE, ttfb_s=0.005) as running:
        yield running


def epoch_of(callback, concurrency):
    @pipeline_def(batch_size=BATCH, py_num_workers=2, **CPU)
    def pipe():
        return fn.external_source(source=callback, parallel=True, batch=False,
                                  concurrency=concurrency, last_batch="partial")

    p = pipe()
    p.build()
    try:
        return [[s.tolist() for s in it[0]] for it in run_epoch(p)]
    finally:
        del p


def test_async_source_through_the_drop_in_gives_the_batches_of_a_plain_one(server):
    reference = epoch_of(BlockingHttpObjects(server.url, RECORDS), 1)
    assert sum(len(b) for b in reference) == RECORDS
    assert reference[3][2] == object_bytes(3 * BATCH + 2, SIZE).tolist()
    assert epoch_of(AsyncHttpObjects(server.url, RECORDS), 32) == reference
    assert epoch_of(BlockingHttpObjects(server.url, RECORDS), 8) == reference


def test_concurrency_without_parallel_is_refused():
    @pipeline_def(batch_size=2, **CPU)
    def pipe():
        return fn.external_source(source=lambda i: np.zeros(1), batch=False, concurrency=4)

    with pytest.raises(ValueError, match="concurrency"):
        pipe()
