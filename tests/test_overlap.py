"""A worker with an ``async def`` callback starts the samples of its next task while the
current task's are in flight: its requests do not drain to zero between tasks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from extsrc import ParallelSource
from extsrc.errors import SourceTimeoutError

BATCH = 8
# Only reached if the worker never starts the next batch's samples (then batch 0 would wait for
# batch 2 forever); the worker then names the waiting sample after 0.8 of it.
TIMEOUT_S = 20.0


class WaitsForTheNextBatch:
    """Samples of batch 1 come back only once a sample of batch 2 has started: possible only
    if the worker runs the two batches' tasks together. (Batch 0 goes alone: the first batch
    tells the source's layout before more memory is reserved.)"""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at
        self.next_started = None

    async def __call__(self, info):
        if self.next_started is None:  # made in the worker, on its own loop
            self.next_started = asyncio.Event()
        if info.iteration >= 2:
            self.next_started.set()
        elif info.iteration == 1:
            await self.next_started.wait()
        await asyncio.sleep(0)
        if info.idx_in_epoch == self.fail_at:
            raise KeyError(f"object {info.idx_in_epoch} is missing")
        return np.full(2, info.idx_in_epoch, np.int64)


def batches(callback, count, **kw):
    with ParallelSource(callback, BATCH, num_workers=1, concurrency=4 * BATCH, prefetch=3,
                        timeout=TIMEOUT_S, **kw) as source:
        out = []
        for batch in source:
            out.append(np.stack(batch)[:, 0].tolist())
            if len(out) == count:
                return out
    return out


def test_the_next_batch_starts_while_this_one_waits_and_batches_stay_in_order():
    got = batches(WaitsForTheNextBatch(), 4)
    assert got == [list(range(b * BATCH, (b + 1) * BATCH)) for b in range(4)]


def test_a_failing_sample_of_the_next_batch_names_itself_after_the_current_batch():
    failing = 2 * BATCH + 3  # in batch 2, which finishes before batch 1
    with ParallelSource(WaitsForTheNextBatch(fail_at=failing), BATCH, num_workers=1,
                        concurrency=4 * BATCH, prefetch=3, timeout=TIMEOUT_S) as source:
        it = iter(source)
        assert np.stack(next(it))[:, 0].tolist() == list(range(BATCH))
        assert np.stack(next(it))[:, 0].tolist() == list(range(BATCH, 2 * BATCH))
        with pytest.raises(KeyError, match=f"object {failing} is missing") as caught:
            next(it)
    assert f"idx_in_epoch={failing}," in str(caught.value.__cause__)
    assert not isinstance(caught.value, SourceTimeoutError)


class PairsOverlap:
    """Each odd batch waits until a sample of the next batch has started, then every sample
    waits ``WAIT_S``: two batches' samples are in flight together, by construction."""

    WAIT_S = 0.05

    def __init__(self):
        self.started = None

    async def __call__(self, info):
        if self.started is None:
            self.started = {}
        event = self.started.setdefault(info.iteration, asyncio.Event())
        event.set()
        if info.iteration % 2 == 1:
            await self.started.setdefault(info.iteration + 1, asyncio.Event()).wait()
        await asyncio.sleep(self.WAIT_S)
        return np.full(2, info.idx_in_epoch, np.int64)


def test_stats_count_two_batches_in_flight_together_once():
    with ParallelSource(PairsOverlap(), BATCH, num_workers=1, concurrency=2 * BATCH, prefetch=3,
                        timeout=TIMEOUT_S) as source:
        epoch = iter(source)
        for _ in range(9):
            next(epoch)
        stats = source.stats()
    # batch 0 alone (BATCH in flight), then pairs (2 * BATCH): the worker's busy time is
    # counted once, so the mean is above one batch's samples
    assert BATCH < stats.in_flight_mean <= 2 * BATCH + 0.01, stats.in_flight_mean
