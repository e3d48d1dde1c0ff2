"""GPU tests of extsrc.torch and extsrc.cupy (marker ``cuda``; skipped without an NVIDIA GPU).

Each check runs in a child process (see gpu_checks.py): CUDA must not be
initialised in the pytest process, whose other tests fork workers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHECKS = os.path.join(os.path.dirname(__file__), "gpu_checks.py")
CHECK_TIMEOUT_S = 300


def _run(check: str) -> None:
    result = subprocess.run([sys.executable, CHECKS, check], capture_output=True, text=True,
                            timeout=CHECK_TIMEOUT_S)
    skipped = next((line for line in result.stdout.splitlines() if line.startswith(f"SKIP {check}")), None)
    if result.returncode == 0 and skipped:
        pytest.skip(skipped)
    assert result.returncode == 0 and f"OK {check}" in result.stdout, (
        f"{check} failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
    )


@pytest.mark.cuda
def test_pinned_cpu_tensors_are_page_locked_and_copies_read_the_right_batch():
    _run("torch_pinned_cpu_tensors")


@pytest.mark.cuda
def test_cuda_device_batches_are_right_dense_and_ragged():
    _run("torch_device_cuda")


@pytest.mark.cuda
def test_copies_to_the_device_overlap_the_work_on_the_previous_batch():
    _run("torch_copy_overlaps_compute")


@pytest.mark.cuda
def test_a_fork_source_after_real_cuda_is_refused_and_spawn_works():
    _run("torch_fork_after_cuda_refused")


@pytest.mark.cuda
def test_cupy_arrays_from_page_locked_batches():
    _run("cupy_to_device")
