"""``python -m extsrc demo``: decodes the bundled set, reports images/s, writes a contact sheet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("nvidia.dali")
Image = pytest.importorskip("PIL.Image")

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = len((ROOT / "extsrc" / "data" / "labels.txt").read_text().splitlines())


def run_demo(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "extsrc", "demo", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def grid_size(images: int, size: int, columns: int = 8, gap: int = 4) -> tuple:
    rows = -(-images // columns)
    return columns * (size + gap) + gap, rows * (size + gap) + gap


def assert_contact_sheet(path: Path, images: int, size: int) -> None:
    assert path.exists(), f"no contact sheet at {path}"
    with Image.open(path) as sheet:
        assert sheet.format == "PNG"
        assert sheet.size == grid_size(images, size)
        pixels = np.asarray(sheet.convert("RGB"))
    assert pixels.std() > 30, "the contact sheet is (nearly) blank"
    # each tile is a decoded image, not a flat colour
    first_tile = pixels[4:4 + size, 4:4 + size]
    last_row_tile = pixels[-4 - size:-4, 4:4 + size]
    for tile in (first_tile, last_row_tile):
        assert len(np.unique(tile.reshape(-1, 3), axis=0)) > 50


def test_demo_decodes_the_set_and_writes_a_contact_sheet(tmp_path):
    out = tmp_path / "sheet.png"
    proc = run_demo("--out", str(out), "--epochs", "2", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert "images/s" in proc.stdout
    assert f"decoded {2 * BUNDLED} images" in proc.stdout
    assert_contact_sheet(out, BUNDLED, 96)


def test_demo_with_spawn_keeps_the_incomplete_last_batch(tmp_path):
    # 64 images in batches of 24: the last batch has 16, and all 64 reach the sheet
    out = tmp_path / "spawn.png"
    proc = run_demo("--out", str(out), "--epochs", "1", "--batch-size", "24",
                    "--start-method", "spawn", "--size", "64", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert f"decoded {BUNDLED} images" in proc.stdout and "images/s" in proc.stdout
    assert_contact_sheet(out, BUNDLED, 64)


def test_demo_rejects_bad_options():
    proc = run_demo("--workers", "0")
    assert proc.returncode == 2
    assert "--workers" in proc.stderr


def test_demo_asked_for_a_gpu_where_there_is_none_says_so(tmp_path):
    from extsrc.engine.cuda_state import gpu_visible

    if gpu_visible()[0]:
        pytest.skip("a GPU is visible here")
    out = run_demo("--device", "gpu", "--out", str(tmp_path / "sheet.png"))
    assert out.returncode == 2
    assert "--device gpu decodes on a GPU, but" in out.stderr and "use --device cpu" in out.stderr
    assert "Traceback" not in out.stderr
