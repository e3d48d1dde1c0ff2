"""from_dataset over a dataset that waits on storage: __getitem__ on threads, or getitem_async."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("aiohttp")

from benchmarks.object_server import ObjectServer, object_bytes  # noqa: E402
from benchmarks.remote_clients import AsyncHttpObjects, BlockingHttpObjects  # noqa: E402
from extsrc.sample_info import SampleInfo  # noqa: E402
from extsrc.torch import from_dataset  # noqa: E402

SIZE, RECORDS = 1500, 45


class HttpDataset:
    """(object bytes, its index) per record; blocks in __getitem__."""

    def __init__(self, url):
        self.get = BlockingHttpObjects(url)

    def __len__(self):
        return RECORDS

    def __getitem__(self, index):
        return self.get(SampleInfo(index, 0, 0, 0)), np.int64(index)


class AsyncHttpDataset(HttpDataset):
    """The same records, also offered by an async method."""

    def __init__(self, url):
        super().__init__(url)
        self.aget = AsyncHttpObjects(url)

    async def getitem_async(self, index):
        data = await self.aget(SampleInfo(index, 0, 0, 0))
        return data, np.int64(-index)  # tells the async path from __getitem__


@pytest.fixture(scope="module")
def server():
    with ObjectServer(size=SIZE, ttfb_s=0.005) as running:
        yield running


def batches(dataset, concurrency):
    with from_dataset(dataset, batch_size=8, shuffle=True, seed=3, num_workers=2,
                      concurrency=concurrency) as loader:
        return [(data.clone(), index.clone()) for data, index in loader]


def test_threads_and_async_method_give_the_batches_of_one_at_a_time(server):
    reference = batches(HttpDataset(server.url), 1)
    indices = torch.cat([i for _, i in reference]).tolist()
    assert sorted(indices) == list(range(RECORDS))
    assert all(torch.equal(row, torch.from_numpy(object_bytes(i, SIZE)))
               for (data, index) in reference for row, i in zip(data, index.tolist()))
    threaded = batches(HttpDataset(server.url), 16)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(threaded, reference))
    awaited = batches(AsyncHttpDataset(server.url), 16)
    assert len(awaited) == len(reference)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], -b[1]) for a, b in zip(awaited, reference))
