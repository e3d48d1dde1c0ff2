"""``python -m extsrc bench --soak MINUTES``: memory traces, slopes and peaks, side by side."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks.soak import (BATCH, EPOCH_BATCHES, SIZES, _aligned_at, sample, slope_mib_per_hour, summary,
                             trend_mib_per_hour)
from extsrc import SampleInfo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_slope_is_in_mib_per_hour_and_leaves_out_the_warm_up():
    assert slope_mib_per_hour([0, 1800, 3600], [0, 1 << 20, 2 << 20]) == pytest.approx(2.0)
    readings = [{"t": t, "batches": t, "consumer": (100 << 20) if t < 12 else (10 << 20) + t * 1000,
                 "shared": 5 << 20, "total": 20 << 20, "workers": [1 << 20], "aligned": True}
                for t in range(0, 61, 3)]
    figures = summary(readings, 1.0)  # warm-up: the first 12 s of a minute
    assert figures["slopes"]["consumer"] == pytest.approx(1000 * 3600 / (1 << 20))
    assert figures["slopes"]["shared"] == pytest.approx(0.0, abs=1e-9)
    assert figures["peaks"]["consumer"] == (10 << 20) + 60_000 and figures["batches"] == 60
    assert figures["peaks"]["total"] == 20 << 20


def test_the_median_slope_leaves_out_a_few_readings_caught_with_a_sample_in_flight():
    times = list(range(0, 3600, 10))
    values = [(100 << 20) + t * 300 + ((40 << 20) if k % 9 == 4 else 0) for k, t in enumerate(times)]
    values[-3:] = [v + (40 << 20) for v in values[-3:]]  # late ones pull a least-squares line up
    assert trend_mib_per_hour(times, values) == pytest.approx(300 * 3600 / (1 << 20), rel=1e-6)
    assert slope_mib_per_hour(times, values) > 1.2 * trend_mib_per_hour(times, values)


def test_readings_between_aligned_ones_count_in_the_peaks_only():
    aligned = [{"t": t, "batches": t, "consumer": 10 << 20, "shared": 5 << 20, "total": 20 << 20,
                "workers": [1 << 20], "aligned": True} for t in range(0, 61, 6)]
    between = [{**r, "t": r["t"] + 3, "batches": r["batches"] + 3, "aligned": False,
                "shared": (5 << 20) + (r["t"] << 20)} for r in aligned]  # held batches at a peak
    figures = summary(sorted(aligned + between, key=lambda r: r["t"]), 1.0)
    assert figures["slopes"]["shared"] == pytest.approx(0.0, abs=1e-9)
    assert figures["peaks"]["shared"] == (5 << 20) + (60 << 20) and figures["batches"] == 63


def test_aligned_readings_come_once_a_cycle_mid_epoch_of_the_smallest_samples():
    # Where the loop's memory repeats from cycle to cycle: every larger size has passed through
    # the slots, and the held batches are the smallest ones; not in the first cycle (warm-up).
    cycles = 3
    aligned = [(epoch, k) for epoch in range(cycles * len(SIZES)) for k in range(EPOCH_BATCHES)
               if _aligned_at(epoch, k)]
    assert len(aligned) == cycles - 1
    for epoch, k in aligned:
        assert 0 < k < EPOCH_BATCHES - 1
        first = k * BATCH  # the batch's first sample: the largest of the batch (ragged)
        size = sample(SampleInfo(first, 0, k, epoch)).nbytes
        assert size == min(SIZES)
        assert {sample(SampleInfo(0, 0, 0, e)).nbytes for e in range(epoch - len(SIZES) + 1, epoch)} \
            == set(SIZES) - {min(SIZES)}  # the others came before, since the last aligned one


@pytest.mark.slow
def test_a_short_soak_prints_each_loaders_traces(tmp_path):
    loaders = "extsrc,dali" if importlib.util.find_spec("nvidia.dali") else "extsrc"
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--soak", "0.15", "--soak-every", "1",
                          "--soak-loaders", loaders, "--json", str(tmp_path / "soak.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for trace in ("consumer", "shared", "total", "worker 0", "worker 1"):
        assert any(line.startswith(trace) for line in out.stdout.splitlines()), out.stdout
    figures = json.loads((tmp_path / "soak.json").read_text())
    assert set(figures) == set(loaders.split(","))
    assert all(len(f["readings"]) >= 3 and f["batches"] > 0 for f in figures.values())
