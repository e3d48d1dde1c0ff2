"""``python -m extsrc doctor``: what works here and what the settings need."""

import os
import subprocess
import sys

import pytest


pytestmark = pytest.mark.slow


def doctor(*args, wrap=(), env=None):
    import os

    return subprocess.run(
        list(wrap) + [sys.executable, "-m", "extsrc", "doctor", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )


def test_doctor_reports_shm_start_methods_gpu_stage_and_needs():
    out = doctor("--batch-size", "16", "--sample-bytes", "4194304")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "/dev/shm:" in text and "memfd: works" in text
    for method in ("fork", "spawn", "forkserver"):
        assert f"{method}" in text
    assert text.count("works (first batch after") == 3
    assert "shared memory needed per source: about 512.0 MiB" in text  # (4 + 3 + 1) x 64 MiB
    assert "DALI" in text and "CuPy" in text


def test_doctor_advises_a_shm_size_when_dev_shm_is_too_small_for_the_settings(small_dev_shm):
    out = doctor("--batch-size", "16", "--sample-bytes", "4194304", wrap=small_dev_shm,
                 env={"EXTSRC_SHM_BACKEND": "devshm"})
    assert out.returncode == 1, out.stderr
    assert "/dev/shm has 16.0 MiB free but these settings need 512.0 MiB" in out.stdout
    assert "--shm-size=" in out.stdout


def test_doctor_finds_a_problem_when_the_settings_need_more_memory_than_the_machine_has():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sample_bytes = 64 << 20
    batch = -(-total // (8 * sample_bytes)) + 1  # 8 batches of this size are more than the memory
    out = doctor("--batch-size", str(batch), "--sample-bytes", str(sample_bytes))
    assert out.returncode == 1, out.stdout
    assert "problems:" in out.stdout and "would refuse them with SharedMemoryError" in out.stdout
    assert "no problems found" not in out.stdout


def test_every_doctor_option_is_documented():
    from extsrc.cli.doctor import _parser

    parser = _parser()
    assert all(action.help for action in parser._actions)
    assert "``" not in parser.format_help()
