"""stats() knows about waiting: samples in flight, and when more concurrency is the fix."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from extsrc import ParallelSource

WAIT_S = 0.02


def sleeping(info):
    time.sleep(WAIT_S)  # stands for a request: the worker waits, the CPU does not work
    return np.zeros(16, np.uint8)


async def awaiting(info):
    await asyncio.sleep(WAIT_S)
    return np.zeros(16, np.uint8)


def stats_after(callback, batches, **kwargs):
    with ParallelSource(callback, 16, num_workers=1, **kwargs) as source:
        epoch = iter(source)
        for _ in range(batches):
            next(epoch)
        return source.stats()


def test_a_waiting_callback_is_told_to_raise_concurrency_not_workers():
    stats = stats_after(sleeping, 4)
    assert stats.worker_cpu_share is not None and stats.worker_cpu_share < 0.5
    diagnosis = stats.diagnosis()
    assert "concurrency=" in diagnosis and "not more workers" in diagnosis, diagnosis
    assert "num_workers=" not in diagnosis
    assert "in flight per worker" in str(stats)


def test_samples_in_flight_are_counted():
    one = stats_after(sleeping, 3)
    many = stats_after(awaiting, 6, concurrency=16)
    assert one.concurrency == 1 and many.concurrency == 16
    assert 0.5 < one.in_flight_mean <= 1.01
    assert many.in_flight_mean > 2
    assert many.callback_median_s is not None and many.callback_median_s >= WAIT_S  # time in flight
