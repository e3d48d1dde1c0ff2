"""concurrency=N without a server: the outcome of a sequential run, whatever finishes first."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from extsrc import ParallelSource

BATCH = 8


def delay(info) -> float:
    return 0.002 * (BATCH - info.idx_in_batch)  # later samples of a batch come back first


def sample(info):
    return np.full(3, info.idx_in_epoch, np.int64)


class Threads:
    def __init__(self, stop_at=None, fail_at=()):
        self.stop_at, self.fail_at = stop_at, fail_at

    def __call__(self, info):
        time.sleep(delay(info))
        if info.idx_in_epoch in self.fail_at:
            raise KeyError(f"sample {info.idx_in_epoch}")
        if self.stop_at is not None and info.idx_in_epoch >= self.stop_at:
            raise StopIteration
        return sample(info)


class Async(Threads):
    async def __call__(self, info):
        await asyncio.sleep(delay(info))
        if info.idx_in_epoch in self.fail_at:
            raise KeyError(f"sample {info.idx_in_epoch}")
        if self.stop_at is not None and info.idx_in_epoch >= self.stop_at:
            raise StopIteration  # inside a coroutine Python makes it a RuntimeError: still the end
        return sample(info)


def epoch(callback, concurrency):
    with ParallelSource(callback, BATCH, num_workers=2, concurrency=concurrency,
                        last_batch="partial") as source:
        return [np.stack(b)[:, 0].tolist() for b in source]


@pytest.mark.parametrize("kind", [Threads, Async])
def test_stop_iteration_ends_the_epoch_at_its_position(kind):
    assert epoch(kind(stop_at=21), 8) == epoch(Threads(stop_at=21), 1)
    assert epoch(kind(stop_at=21), 8)[-1] == [16, 17, 18, 19, 20]


@pytest.mark.parametrize("kind", [Threads, Async])
def test_an_end_before_an_error_wins_and_the_first_error_by_position_wins(kind):
    # sample 13 ends the epoch; 14 fails (and comes back first): a sequential run never calls 14
    assert epoch(kind(stop_at=13, fail_at=(14,)), 8)[-1] == [8, 9, 10, 11, 12]
    with pytest.raises(KeyError, match="sample 11") as caught:
        epoch(kind(fail_at=(11, 14)), 8)
    assert "idx_in_epoch=11," in str(caught.value.__cause__)


def test_an_async_callback_is_awaited_even_with_concurrency_1():
    assert epoch(Async(stop_at=20), 1) == epoch(Threads(stop_at=20), 1)
