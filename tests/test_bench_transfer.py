"""``python -m extsrc bench --h2d``: batches to a GPU in GB/s, refused clearly without one."""

import glob
import re

import pytest

from test_bench import bench, installed, table_rows

TITLE = "Batches to GPU 0"
NAMES = ('TorchLoader(pin_memory=True), .to("cuda", non_blocking=True)',
         'TorchLoader(device="cuda", pin_memory=True)',
         'DataLoader(pin_memory=True), .to("cuda", non_blocking=True)',
         'TorchLoader(), pageable, .to("cuda")', 'DataLoader(), pageable, .to("cuda")')
has_gpu_node = bool(glob.glob("/dev/nvidia[0-9]*"))


@pytest.mark.skipif(has_gpu_node, reason="checks the refusal where no GPU is visible")
def test_h2d_without_a_gpu_is_refused_with_the_reason():
    out = bench("--h2d", "--quick", timeout=120)
    assert out.returncode == 2
    assert "extsrc bench: --h2d copies batches to a GPU, but" in out.stderr
    assert TITLE not in out.stdout, "no cell runs"


def test_the_h2d_table_gives_the_reference_over_each_loader():
    from benchmarks.transfer import LOADERS, table

    runs = {loader.key: [{"gb_per_s": 10.0 * (i + 1), "loader_cpu": 1.0}] for i, loader in enumerate(LOADERS)}
    runs[LOADERS[0].key].append({"gb_per_s": 14.0, "loader_cpu": 1.0})  # median of 10 and 14: 12
    runs[LOADERS[4].key] = []  # every run of it failed
    rows = table_rows(table(runs) + "\n", TITLE)[1:]
    assert [row[0] for row in rows] == list(NAMES)
    assert rows[0][1:] == ["12.00", "1.00", "1.00x (reference)"]
    assert rows[1][3] == "0.60x" and rows[3][3] == "0.30x"  # 12 / 20, 12 / 40
    assert rows[4][1] == "n/a" and rows[4][3] == "n/a"


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not installed("torch"), reason="needs PyTorch")
def test_quick_h2d_bench_measures_every_loader_on_a_gpu():
    out = bench("--h2d", "--quick")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = table_rows(out.stdout, TITLE)[1:]
    assert [row[0] for row in rows] == list(NAMES)
    for name, rate, _cores, ratio in rows:
        assert re.fullmatch(r"\d+\.\d\d", rate) and float(rate) > 0, (name, rate)
        assert re.fullmatch(r"\d+\.\d\dx( \(reference\))?", ratio), (name, ratio)
