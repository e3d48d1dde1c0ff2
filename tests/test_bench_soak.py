"""``python -m extsrc bench --soak MINUTES``: memory traces, slopes and peaks, side by side."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks.soak import slope_mib_per_hour, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_slope_is_in_mib_per_hour_and_leaves_out_the_warm_up():
    assert slope_mib_per_hour([0, 1800, 3600], [0, 1 << 20, 2 << 20]) == pytest.approx(2.0)
    readings = [{"t": t, "batches": t, "consumer": (100 << 20) if t < 12 else (10 << 20) + t * 1000,
                 "shared": 5 << 20, "total": 20 << 20, "workers": [1 << 20]}
                for t in range(0, 61, 3)]
    figures = summary(readings, 1.0)  # warm-up: the first 12 s of a minute
    assert figures["slopes"]["consumer"] == pytest.approx(1000 * 3600 / (1 << 20))
    assert figures["slopes"]["shared"] == pytest.approx(0.0, abs=1e-9)
    assert figures["peaks"]["consumer"] == (10 << 20) + 60_000 and figures["batches"] == 60
    assert figures["peaks"]["total"] == 20 << 20


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
