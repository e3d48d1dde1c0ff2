"""Callbacks that wait on storage: concurrency=N, async def and threads, against a real HTTP server.

The server (benchmarks.object_server) runs in its own process on loopback,
with a time to first byte, so that samples of one worker really are in
flight together and come back out of order.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

pytest.importorskip("aiohttp")

import extsrc  # noqa: E402
from extsrc import Order, ParallelSource  # noqa: E402
from benchmarks.object_server import ObjectServer, object_bytes  # noqa: E402
from benchmarks.remote_clients import AsyncHttpObjects, BlockingHttpObjects  # noqa: E402
from faultkit import run_fault  # noqa: E402

SIZE = 3000
RECORDS = 150  # not a multiple of the batch: a short last batch
BATCH = 16
MISSING = RECORDS + 5  # the server answers 404 for this object (past the epochs of other tests)


@pytest.fixture(scope="module")
def server():
    with ObjectServer(size=SIZE, ttfb_s=0.005, missing=[MISSING]) as running:
        yield running


def expected(record: int) -> np.ndarray:
    return object_bytes(record, SIZE)


def take_all(source, limit=None):
    out = []
    for batch in source:
        out.append([np.array(sample) for sample in batch])
        if limit is not None and len(out) == limit:
            break
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(np.array_equal(s, t) for s, t in zip(x, y)) for x, y in zip(a, b))


class SlowFirst:
    """Wraps a callback so that early samples of each batch come back last (out of order)."""

    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, info):
        await asyncio.sleep(0.002 * (BATCH - info.idx_in_batch))
        return await self.inner(info)


def run(callback, concurrency, **kwargs):
    with ParallelSource(callback, BATCH, num_workers=2, concurrency=concurrency, **kwargs) as source:
        return take_all(source)


@pytest.mark.slow
@pytest.mark.parametrize("order", [None, Order(RECORDS, shuffle=True, seed=5)])
def test_same_batches_for_any_concurrency_async_and_threads(server, order):
    count = None if order is not None else RECORDS
    kwargs = dict(order=order, last_batch="partial")
    reference = run(BlockingHttpObjects(server.url, count), 1, **kwargs)
    records = list(order.epoch(0)) if order is not None else list(range(RECORDS))
    assert sum(len(b) for b in reference) == RECORDS
    flat = [s for b in reference for s in b]
    assert all(np.array_equal(s, expected(r)) for s, r in zip(flat, records))
    for callback, concurrency, timeout in ((AsyncHttpObjects(server.url, count), 64, None),
                                           (SlowFirst(AsyncHttpObjects(server.url, count)), 64, 60),
                                           (AsyncHttpObjects(server.url, count), 1, None),
                                           (BlockingHttpObjects(server.url, count), 8, None),
                                           (BlockingHttpObjects(server.url, count), 8, 60)):
        got = run(callback, concurrency, timeout=timeout, **kwargs)
        assert same(got, reference), (callback, concurrency, timeout)


def test_batch_mode_async_callback_gathers_its_requests(server):
    objects = AsyncHttpObjects(server.url)

    async def batch(info):
        if info.iteration * BATCH >= RECORDS:
            raise StopIteration
        infos = [extsrc.SampleInfo(info.iteration * BATCH + k, k, info.iteration, info.epoch_idx)
                 for k in range(min(BATCH, RECORDS - info.iteration * BATCH))]
        return list(await asyncio.gather(*(objects(i) for i in infos)))

    with ParallelSource(batch, BATCH, num_workers=2, batch=True, hooks=extsrc.Hooks(batch_info=True),
                        last_batch="partial") as source:
        got = take_all(source)
    assert same(got, run(BlockingHttpObjects(server.url, RECORDS), 1, last_batch="partial"))


def test_concurrency_with_batch_mode_or_in_place_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="needs sample mode"):
        ParallelSource(lambda i: [np.zeros(1)], 4, batch=True, concurrency=4)
    with pytest.raises(ValueError, match="in_place=True"):
        ParallelSource(lambda i, b: np.zeros(1), 4, in_place=True, concurrency=4)
    with pytest.raises(ValueError, match="concurrency must be a positive int"):
        ParallelSource(lambda i: np.zeros(1), 4, concurrency=0)


def test_exact_resume_mid_epoch(server):
    order = Order(RECORDS, shuffle=True, seed=9)
    callback = AsyncHttpObjects(server.url)
    with ParallelSource(callback, BATCH, num_workers=2, concurrency=32, order=order) as source:
        epoch = iter(source)
        head = [[np.array(s) for s in next(epoch)] for _ in range(3)]
        state = source.get_state()
        rest = [[np.array(s) for s in b] for b in epoch]
    with ParallelSource(BlockingHttpObjects(server.url), BATCH, num_workers=1, concurrency=4,
                        order=order) as source:
        source.set_state(state)
        resumed = take_all(source)
    with ParallelSource(BlockingHttpObjects(server.url), BATCH, num_workers=1, order=order) as source:
        whole = take_all(source)
    assert same(resumed, rest) and same(head + rest, whole)


@pytest.mark.parametrize("kind", ["async", "threads"])
def test_a_missing_object_names_its_sample_with_the_traceback(server, kind):
    callback = (AsyncHttpObjects if kind == "async" else BlockingHttpObjects)(server.url)
    with ParallelSource(callback, BATCH, num_workers=2, concurrency=16) as source:
        with pytest.raises(FileNotFoundError, match=f"objects/{MISSING}") as caught:
            take_all(source)
    cause = str(caught.value.__cause__)
    assert f"idx_in_epoch={MISSING}," in cause and "HTTP 404" in cause
    assert "remote_clients.py" in cause  # the worker's traceback, down to the client


def test_the_first_failing_sample_wins_whatever_the_timing(server):
    class Failing:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, info):
            if info.idx_in_batch == 9:
                await asyncio.sleep(0.2)  # fails last in time, first by position
                raise KeyError(f"first by position {info.idx_in_epoch}")
            if info.idx_in_batch == 12:
                raise ValueError("later by position, first in time")
            return await self.inner(info)

    with ParallelSource(Failing(AsyncHttpObjects(server.url)), BATCH, num_workers=1,
                        concurrency=16) as source:
        with pytest.raises(KeyError, match="first by position 9"):
            take_all(source)


def test_a_server_that_is_down_gives_a_clear_error():
    with ObjectServer(size=SIZE) as gone:
        url = gone.url
    for callback in (AsyncHttpObjects(url), BlockingHttpObjects(url)):
        with ParallelSource(callback, 4, concurrency=4) as source:
            with pytest.raises(ConnectionError, match="cannot be reached") as caught:
                take_all(source)
            assert "idx_in_epoch=0," in str(caught.value.__cause__)


def test_no_descriptor_left_after_many_sources(server):
    def fds():
        return len(os.listdir("/proc/self/fd"))

    run(AsyncHttpObjects(server.url, 40), 8)  # first use: imports, caches
    before = fds()
    for _ in range(3):
        run(AsyncHttpObjects(server.url, 40), 8)
        run(BlockingHttpObjects(server.url, 40), 8)
    assert fds() <= before


HANG = '''
import aiohttp  # imported before the fork: the first batch does not wait for the import
import numpy as np
import extsrc
from benchmarks.object_server import ObjectServer
from benchmarks.remote_clients import {client}

class HangAt({client}):
    def _target(self, info):
        target = super()._target(info)
        return target.replace("/objects/", "/hang/") if info.idx_in_epoch == 21 else target

def run(report):
    with ObjectServer(size=1000) as server:
        with extsrc.ParallelSource(HangAt(server.url), 8, num_workers=2, concurrency=8,
                                   timeout=8) as source:
            source.start()
            report.pids(source.worker_pids())
            report.fault_starts()
            for _ in source:
                pass
'''


@pytest.mark.slow
@pytest.mark.parametrize("client", ["AsyncHttpObjects", "BlockingHttpObjects"])
def test_a_hanging_request_is_caught_by_timeout_and_named(client):
    result = run_fault(HANG.format(client=client), timeout=60)
    assert result.type == "SourceTimeoutError", (result.type, result.message, result.stderr)
    assert "idx_in_epoch=21," in result.message and "timeout=8" in result.message
    assert "remote_clients.py" in result.cause  # where the request was waiting
    assert result.leftover_pids == []
    assert [e for e in result.new_shm if "extsrc" in e or e.startswith("psm_")] == []
