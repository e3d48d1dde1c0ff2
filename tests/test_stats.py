"""Statistics: the figures add up, and the diagnosis names the side that is the bottleneck."""

import logging
import time

import numpy as np
import pytest

from extsrc import ParallelSource


def ragged(info):
    return np.zeros(100, np.uint8), np.zeros(info.idx_in_batch + 1, np.float64)


def test_samples_and_bytes_add_up_exactly_dense_and_ragged():
    with ParallelSource(ragged, 4, num_outputs=2, num_workers=2) as src:
        it = iter(src)
        for _ in range(10):
            next(it)
        stats = src.stats()
    assert stats.batches == 10 and stats.samples == 40
    assert stats.bytes == 10 * (4 * 100 + (1 + 2 + 3 + 4) * 8)
    assert len(stats.worker_busy) == 2 and stats.shared_memory_bytes > 0


def slow_callback(info):
    time.sleep(0.01)
    return np.zeros(16, np.uint8)


def fast_callback(info):
    return np.zeros(16, np.uint8)


def test_a_slow_callback_is_diagnosed_as_input_bound():
    with ParallelSource(slow_callback, 4, num_workers=2) as src:
        it = iter(src)
        for _ in range(15):
            next(it)
        stats = src.stats()
    assert stats.wait_fraction > 0.6
    assert stats.input_bound and stats.diagnosis().startswith("Input-bound")
    assert "concurrency=" in stats.diagnosis()  # a callback that sleeps waits: more in flight, not more workers
    assert 0.009 < stats.callback_median_s < 0.05 and stats.callback_max_s >= stats.callback_median_s
    assert stats.mean_worker_busy > 0.6


def test_a_slow_consumer_is_diagnosed_as_consumer_bound():
    with ParallelSource(fast_callback, 4, num_workers=2) as src:
        it = iter(src)
        next(it)
        src.stats(reset=True)  # leave the start-up out
        for _ in range(15):
            next(it)
            time.sleep(0.02)  # the training step
        stats = src.stats()
    assert stats.wait_fraction < 0.1
    assert not stats.input_bound and stats.diagnosis().startswith("Consumer-bound")
    assert stats.ready_ahead >= 1 and stats.mean_worker_busy < 0.9


def test_the_report_is_short_and_ends_in_the_diagnosis():
    with ParallelSource(slow_callback, 4, num_workers=1) as src:
        it = iter(src)
        for _ in range(3):
            next(it)
        report = str(src.stats())
    lines = report.splitlines()
    assert len(lines) <= 8 and lines[-1].startswith("  diagnosis: Input-bound")
    assert "consumer waited" in report and "workers busy" in report and "callback per sample" in report


def test_reset_starts_a_new_window():
    with ParallelSource(fast_callback, 4) as src:
        it = iter(src)
        for _ in range(5):
            next(it)
        assert src.stats(reset=True).batches == 5
        next(it)
        assert src.stats().batches == 1


def test_stats_every_logs_the_report(caplog):
    with caplog.at_level(logging.INFO, logger="extsrc"):
        with ParallelSource(fast_callback, 4, stats_every=0.05) as src:
            it = iter(src)
            for _ in range(20):
                next(it)
                time.sleep(0.01)
    reports = [r.getMessage() for r in caplog.records if r.name == "extsrc"]
    assert reports and all(r.startswith("extsrc source #0:") for r in reports)


def test_stats_can_be_turned_off_and_then_say_so():
    with ParallelSource(fast_callback, 4, stats=False) as src:
        next(iter(src))
        with pytest.raises(RuntimeError, match="stats=False"):
            src.stats()
    with pytest.raises(ValueError, match="stats_every logs the statistics, which stats=False turns off"):
        ParallelSource(fast_callback, 4, stats=False, stats_every=1)
