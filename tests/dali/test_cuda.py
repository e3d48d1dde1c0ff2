"""GPU tests (skipped without an NVIDIA GPU): extsrc buffers consumed by DALI GPU operators.

Each check runs in a child process (see cuda_checks.py): CUDA must not be
initialised in the pytest process, whose other tests fork workers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHECKS = os.path.join(os.path.dirname(__file__), "cuda_checks.py")


def _run(check: str) -> None:
    result = subprocess.run(
        [sys.executable, CHECKS, check], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and f"OK {check}" in result.stdout, (
        f"{check} failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
    )


@pytest.mark.cuda
@pytest.mark.parametrize("check", ["mixed_decoder", "mixed_decoder_spawn"])
def test_mixed_decoder_consumes_extsrc_buffers(check):
    _run(check)


@pytest.mark.cuda
def test_fork_after_real_cuda_is_refused():
    _run("fork_after_cuda_refused")


@pytest.mark.cuda
def test_outputs_kept_in_a_gpu_pipeline_stay_right():
    _run("outputs_kept_on_gpu")


@pytest.mark.cuda
def test_a_framework_iterator_over_a_mixed_decoder_gets_every_image_right():
    _run("iterator_mixed_decoder")
