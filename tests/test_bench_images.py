"""``python -m extsrc bench --images``: every loader runs on a tiny generated set and the table has ratios.

The runs are short (``--quick``, 64 small images) and assert what a reader
of the table relies on, never a speed.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from test_bench import ROOT, bench, table_rows

TITLE = "Images/s, on the CPU"
TINY = ("--image-count", "64", "--image-size", "160x120")
LOADER_NAMES = ("extsrc drop-in + DALI decoder", "DALI parallel external source + DALI decoder",
                "DALI fn.readers.file + DALI decoder", "PyTorch DataLoader + PIL + ",
                "extsrc.ParallelSource + PIL/NumPy in the callback",
                "dynamic mode: extsrc.dynamic parallel source + DALI decoder",
                "dynamic mode: DALI's ndd.ExternalSource (in-process) + DALI decoder",
                "dynamic mode: extsrc.dynamic parallel source decoding with PIL",
                "dynamic mode: DALI's ndd.ExternalSource (in-process) decoding with PIL")
TARGETS = {1: ">= 1x", 2: ">= 0.9x", 3: ">= 1.3x"}
RATIO = r"\d+\.\d\dx"
RATIO_CELL = 5  # loader, images/s, cores used, images per core-second, consumer CPU, ratio, target, met


def installed(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


needs_dali = pytest.mark.skipif(not installed("nvidia.dali"), reason="needs NVIDIA DALI")


def image_rows(stdout):
    rows = [row for row in table_rows(stdout, TITLE) if row[0] != "loader"]  # without the header
    assert len(rows) == len(LOADER_NAMES), stdout
    for row, name in zip(rows, LOADER_NAMES):
        assert row[0].startswith(name), f"{row[0]!r} is not {name!r}"
    return rows


def assert_measured(row):
    name, rate, cores, per_core, consumer, ratio, target, met = row
    assert re.fullmatch(r"[\d,]+( \*)?", rate), f"{name}: images/s {rate!r}"
    assert re.fullmatch(r"\d+\.\d\d ms", consumer), f"{name}: consumer CPU per batch {consumer!r}"
    assert re.fullmatch(r"\d+\.\d\d", cores), f"{name}: cores {cores!r}"
    assert re.fullmatch(r"[\d,]+", per_core), f"{name}: images per core-second {per_core!r}"


@pytest.mark.slow
@needs_dali
def test_quick_images_bench_runs_every_loader_and_prints_ratios(tmp_path):
    report, chart = tmp_path / "images.json", tmp_path / "images.png"
    plot = ("--plot", str(chart)) if installed("matplotlib") else ()
    out = bench("--images", "--quick", *TINY, "--images-dir", str(tmp_path / "cache"),
                "--json", str(report), *plot)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "DALI decodes only the crop's window (fn.decoders.image_random_crop + fn.resize)" in out.stdout
    rows = image_rows(out.stdout)
    skipped = set()
    if not installed("torch"):
        assert "PyTorch is not installed" in out.stdout
        skipped.add(3)
    elif "PIL/NumPy transforms" in rows[3][0]:
        assert "the DataLoader column runs the same operations in PIL and NumPy" in out.stdout
    for i, row in enumerate(rows):
        if i in skipped:
            assert row[1] == "n/a" and row[RATIO_CELL] == "n/a" and row[RATIO_CELL + 2] == "n/a", row
            continue
        assert_measured(row)
        if i == 0:
            assert row[RATIO_CELL] == "1.00x (reference)"
        else:
            assert re.fullmatch(RATIO, row[RATIO_CELL]), f"{row[0]}: ratio {row[RATIO_CELL]!r}"
        if i in TARGETS:
            assert row[RATIO_CELL + 1] == TARGETS[i] and row[RATIO_CELL + 2] in ("yes", "no"), row
    if installed("torch"):
        assert re.search(r"extsrc\.ParallelSource vs PyTorch DataLoader, both decoding with PIL: \d+\.\d\dx",
                         out.stdout)
    assert re.search(r"dynamic mode, extsrc.dynamic's parallel source vs DALI's in-process "
                     r"ndd.ExternalSource, both decoding with PIL in the source: \d+\.\d\dx \(target >= "
                     r"1.8x\); with DALI's decoder vs the pipeline drop-in: \d+\.\d\dx \(target >= 0.9x\)",
                     out.stdout)

    figures = json.loads(report.read_text())
    assert figures["settings"]["images"]["count"] == 64 and figures["reference"] == "extsrc-dali"
    for loader in figures["loaders"]:
        if loader["note"] is None:
            (run,) = loader["runs"]
            assert run["images_per_s"] > 0 and run["batches"] >= 1, loader["name"]
    if plot:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the set was made once, where asked, and is reused by a second run
    (folder,) = os.listdir(tmp_path / "cache")
    assert folder.startswith("n64-160x120-q90")
    assert len(os.listdir(tmp_path / "cache" / folder / "images")) == 64


@pytest.mark.slow
@needs_dali
def test_without_torch_the_images_dataloader_column_is_skipped_with_a_note(tmp_path):
    # also the DALI pipelines' other form: whole images decoded, then cropped
    code = ("import sys; sys.modules['torch'] = None; from benchmarks.runner import main; "
            f"sys.exit(main(['--images', '--quick', *{TINY!r}, '--images-dir', {str(tmp_path)!r}, "
            "'--image-decode', 'full']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "DALI decodes whole images (fn.decoders.image + fn.random_resized_crop)" in out.stdout
    assert "PyTorch is not installed: the DataLoader column is skipped" in out.stdout
    rows = image_rows(out.stdout)
    name, rate, cores, per_core, consumer, ratio, target, met = rows[3]
    assert rate == "n/a" and ratio == "n/a" and met == "n/a"
    for row in rows[:3] + rows[4:]:
        assert_measured(row)


@pytest.mark.parametrize("args, message", [
    (("--image-size", "500"), "--image-size must be WIDTHxHEIGHT"),
    (("--image-count", "0"), "count must be an int >= 1, got 0"),
    (("--image-workers", "0"), "--image-workers must be >= 1, got 0"),
])
def test_bad_image_options_are_refused_before_anything_runs(args, message, tmp_path):
    out = bench("--images", *args, "--images-dir", str(tmp_path), timeout=60)
    assert out.returncode == 2
    assert message in out.stderr
    assert os.listdir(tmp_path) == [], "nothing is generated for a refused run"


def test_an_image_folder_that_cannot_be_written_is_reported(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = bench("--images", *TINY, "--images-dir", str(blocker / "cache"), timeout=120)
    assert out.returncode == 2
    assert f"cannot make the image set under {blocker / 'cache'}" in out.stderr
    assert "--images-dir" in out.stderr


def test_help_names_the_image_options_and_targets():
    out = bench("--help", timeout=60)
    assert out.returncode == 0
    for option in ("--images", "--image-count", "--image-workers", "--image-decode", "--images-dir", "--plot"):
        assert option in out.stdout
    assert "DALI fn.readers.file + DALI decoder: >= 0.9x" in out.stdout


@pytest.mark.slow
@pytest.mark.cuda
@needs_dali
@pytest.mark.skipif(not any(os.path.exists(f"/dev/nvidia{i}") for i in range(8)), reason="needs an NVIDIA GPU")
def test_quick_images_bench_with_mixed_decoding(tmp_path):
    out = bench("--images", "--quick", *TINY, "--image-device", "mixed", "--images-dir", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [row for row in table_rows(out.stdout, "Images/s, DALI decoding on GPU 0") if row[0] != "loader"]
    assert len(rows) == len(LOADER_NAMES)
    for row in rows[:3]:
        assert_measured(row)
