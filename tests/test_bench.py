"""``python -m extsrc bench``: every comparison runs and prints a full table.

The benchmark runs are short (``--quick``) and assert what a reader of the
table relies on (one row per workload, numeric ratios, a verdict per target,
exit code 0), never a speed.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD_ROWS = ("small: 1 KiB uint8, batch 256", "large: 4 MiB uint8, batch 16",
                 "cpu: 2 ms busy loop, batch 32")
STARTUP_ROW = "build() to first batch, spawn, 4 workers"
CONSUMED_ROW = "large: 4 MiB uint8, batch 16, output sliced to 8 bytes (no output copy)"
FILL_ROW = "large-fill: 4 MiB written by the callback (in place: extsrc's in_place=True), batch 16"
FRESH_ROW = "large-fresh: a new 4 MiB array per sample, batch 16"
RAGGED_ROW = "ragged: a new array of 256 B to 1.75 KiB per sample, batch 256"
TORCH_RAGGED_ROW = f"{RAGGED_ROW} (DataLoader: a collate_fn keeping the list)"
FAULTS = re.compile(r"[\d,]+ faults/sample")


def installed(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def bench(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "extsrc", "bench", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )


def table_rows(stdout, title):
    """The rows of the Markdown table printed under ``title``, as lists of cells."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        if line.startswith("|") and not line.startswith("|---") and not line.startswith("| workload"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


CONSUMER_CPU = re.compile(r"; consumer \d+\.\d\d ms CPU/batch")


def assert_full_table(rows, labels):
    assert [row[0] for row in rows] == list(labels)
    for label, ours, peer, ratio, target, met in rows:
        if not label.startswith("build()"):  # each loader's training-process CPU beside its rate
            assert CONSUMER_CPU.search(ours) and CONSUMER_CPU.search(peer), label
        assert re.fullmatch(r"\d+\.\d\dx", ratio), f"{label}: ratio {ratio!r} is not a number"
        assert ours not in ("error", "n/a") and peer not in ("error", "n/a"), label
        assert target.startswith(">=") or target == "no slower", label
        assert met in ("yes", "no"), label


def test_importing_the_bench_runner_imports_neither_torch_nor_dali_nor_ray():
    code = ("import sys, benchmarks.runner; "
            "print(sorted(m for m in ('torch', 'nvidia.dali', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_benchmarks_run_as_their_own_module_from_the_checkout():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--workloads", "tiny"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown workload(s) ['tiny']" in out.stderr, out.stderr


def test_bench_command_without_the_benchmarks_folder_says_where_they_are(tmp_path):
    """An installed extsrc (no benchmarks/ beside it) refuses clearly instead of a traceback."""
    installed_copy = tmp_path / "site-packages"
    shutil.copytree(os.path.join(ROOT, "extsrc"), installed_copy / "extsrc")
    env = {**os.environ, "PYTHONPATH": str(installed_copy)}
    out = subprocess.run([sys.executable, "-m", "extsrc", "bench", "--quick"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "not installed with the package" in out.stderr
    assert str(installed_copy / "benchmarks") in out.stderr  # where it looked
    assert "python -m benchmarks" in out.stderr  # and what to run instead


def test_a_benchmarks_package_installed_beside_extsrc_is_not_run_for_ours(tmp_path):
    """In site-packages (no checkout), a 'benchmarks' beside extsrc is another distribution's."""
    site = tmp_path / "site-packages"
    shutil.copytree(os.path.join(ROOT, "extsrc"), site / "extsrc")
    (site / "benchmarks").mkdir()
    (site / "benchmarks" / "__init__.py").write_text("")
    (site / "benchmarks" / "runner.py").write_text("def main(argv):\n    print('not extsrc')\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-m", "extsrc", "bench", "--quick"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not extsrc" not in out.stdout
    assert "not a source checkout" in out.stderr and "python -m benchmarks" in out.stderr


def test_a_benchmarks_folder_in_the_working_directory_does_not_replace_ours(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "runner.py").write_text("def main(argv):\n    print('not extsrc')\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "extsrc", "bench", "--workloads", "tiny"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert "not extsrc" not in out.stdout
    assert out.returncode == 2 and "tiny" in out.stderr


def test_help_names_the_comparisons_and_targets():
    out = bench("--help", timeout=60)
    assert out.returncode == 0
    assert "--dali" in out.stdout and "--quick" in out.stdout and "--json" in out.stdout
    assert ">= 4x samples/s" in out.stdout and ">= 0.95 of ideal" in out.stdout


def test_unknown_workload_is_refused():
    out = bench("--workloads", "tiny", timeout=60)
    assert out.returncode == 2
    assert "tiny" in out.stderr


@pytest.mark.slow
def test_quick_bench_against_dataloader_prints_every_workload_with_ratios(tmp_path):
    report = tmp_path / "bench.json"
    out = bench("--quick", "--json", str(report))
    assert out.returncode == 0, out.stdout + out.stderr
    title = "extsrc.ParallelSource vs PyTorch DataLoader"
    rows = table_rows(out.stdout, title)
    if not installed("torch"):
        assert "PyTorch is not installed" in out.stdout
        assert [row[0] for row in rows] == list(WORKLOAD_ROWS) + [FILL_ROW, TORCH_RAGGED_ROW]
        return
    assert_full_table(rows, WORKLOAD_ROWS + (FILL_ROW, TORCH_RAGGED_ROW))
    assert FAULTS.search(rows[-2][1]) and FAULTS.search(rows[-2][2])  # faults beside each loader
    figures = json.loads(report.read_text())
    (table,) = figures["tables"]
    for row in table["rows"]:
        assert isinstance(row["ratio"], float) and row["met"] in (True, False)
        assert row["extsrc"][0]["samples_per_s"] > 0 and row["DataLoader"][0]["samples_per_s"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not installed("nvidia.dali"), reason="needs NVIDIA DALI")
@pytest.mark.skipif(not installed("extsrc.dali"), reason="needs the extsrc DALI drop-in (extsrc.dali)")
def test_quick_bench_against_dali_prints_every_workload_and_startup_with_ratios():
    out = bench("--quick", "--dali", "--no-torch")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = table_rows(out.stdout, "extsrc drop-in vs DALI parallel external source")
    assert_full_table(rows, WORKLOAD_ROWS + (CONSUMED_ROW, f"{FRESH_ROW}, output sliced",
                                            f"{FILL_ROW}, output sliced", RAGGED_ROW, STARTUP_ROW))
    fresh = rows[4]
    assert FAULTS.search(fresh[1]) and FAULTS.search(fresh[2]) and fresh[4].endswith("faults <= peer's")


@pytest.mark.slow
def test_without_torch_the_dataloader_column_is_skipped_with_a_note():
    code = ("import sys; sys.modules['torch'] = None; from benchmarks.runner import main; "
            "sys.exit(main(['--quick', '--workloads', 'cpu']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PyTorch is not installed" in out.stdout
    (row,) = table_rows(out.stdout, "extsrc.ParallelSource vs PyTorch DataLoader")
    label, ours, peer, ratio, target, met = row
    assert label == WORKLOAD_ROWS[2] and "samples/s" in ours
    assert peer == "n/a" and ratio == "n/a" and met in ("yes", "no")


@pytest.mark.slow
def test_quick_features_bench_prints_the_cost_of_statistics_and_order_and_its_memory():
    out = bench("--no-torch", "--features", "--quick", "--workloads", "small")
    assert out.returncode == 0, out.stderr
    rows = table_rows(out.stdout, "cost of extsrc features")
    assert [row[0] for row in rows] == [
        "small: 1 KiB uint8, batch 256: statistics on vs off",
        "small: 1 KiB uint8, batch 256: shuffled order of 1e+09 records vs identity order",
        "worker memory (VmRSS): shuffled order of 1e+09 records vs identity order",
    ]
    stats, throughput, memory = rows
    assert re.fullmatch(r"\d+\.\d\dx", stats[3]) and stats[4] == ">= 0.98x samples/s"
    assert re.fullmatch(r"\d+\.\d\dx", throughput[3]) and throughput[4] == ">= 0.95x samples/s"
    assert re.fullmatch(r"[+-]\d+\.\d\d MiB", memory[3]) and memory[4] == "< 1 MiB more"
    assert all(row[5] in ("yes", "no") for row in rows)


@pytest.mark.slow
@pytest.mark.skipif(not installed("torch"), reason="needs PyTorch")
def test_quick_from_dataset_bench_prints_every_workload_against_the_dataloader():
    out = bench("--quick", "--no-torch", "--torch-api")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = table_rows(out.stdout, "extsrc.torch.from_dataset vs PyTorch DataLoader, same Dataset")
    extra = [f"{w}, {kind}" for kind in ("collate_fn=stack", "IterableDataset") for w in WORKLOAD_ROWS[:2]]
    shaped = ["tensor: a new 3x32x32 float32 tensor per sample",
              "dict: {image: a new 3x32x32 float32 tensor, label: int}"]
    extra += [f"{w}, batch 128, epochs of 32 batches" for w in shaped]
    extra += [f"{shaped[1]}, batch 128, a collate_fn calling default_collate"]
    extra += [f"{w}, batch 128, num_workers=0" for w in shaped]
    assert_full_table(rows, WORKLOAD_ROWS + tuple(extra))
    assert [row[4].split(" (is")[0] for row in rows] == [
        ">= 3x samples/s", ">= 3x MB/s", ">= 0.95 of ideal",
        ">= 1.5x samples/s", ">= 1.5x MB/s", ">= 1.5x samples/s", ">= 1.5x MB/s",
        ">= 1.5x samples/s", ">= 1.5x samples/s", ">= 1.5x samples/s", ">= 1x samples/s", ">= 1x samples/s"]


@pytest.mark.slow
def test_quick_training_step_bench_compares_each_loader_with_ready_batches():
    out = bench("--no-torch", "--training-step", "--quick", "--workloads", "small")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = table_rows(out.stdout, "training step: 3 ms of one thread's CPU per batch")
    names = ["extsrc.ParallelSource"] + (["extsrc drop-in (num_threads=1)"] if installed("nvidia.dali") else [])
    assert [row[0] for row in rows] == names
    steps = r"[\d,]+ steps/s( \*)?"  # *: the machine was busy during every run of the cell
    for label, ours, ready, ratio, target, met in rows:
        assert re.fullmatch(steps, ours) and re.fullmatch(steps, ready), label
        assert re.fullmatch(r"\d+\.\d\dx", ratio) and target == ">= 0.9x steps/s" and met in ("yes", "no")
