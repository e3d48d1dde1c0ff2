"""Asking for more memory than the process may have is an error with the sizes, never an OOM kill.

Each case runs in its own interpreter with a time limit.
"""

import pytest

from faultkit import memory_cgroup, run_fault

LARGE = '''
import numpy as np, extsrc
def big(info):
    return np.full(({mib} << 20,), info.idx_in_epoch % 256, np.uint8)
def run(report):
    src = extsrc.ParallelSource(big, 8, num_workers=2)
    report.pids(src.pool.worker_pids())
    try:
        it = iter(src)
        for _ in range(6):
            next(it)
    finally:
        src.close()
'''


@pytest.mark.slow
def test_a_memory_cgroup_too_small_for_the_batches_gives_shared_memory_error_not_oom_kill():
    with memory_cgroup(384 << 20) as wrap:
        if wrap is None:
            pytest.skip("no memory cgroup can be made here (needs root and a memory controller)")
        result = run_fault(LARGE.format(mib=32), wrap=wrap, timeout=120)  # 256 MiB batches
    assert result.returncode == 0, result.stderr[-2000:]  # not killed
    assert result.type == "SharedMemoryError", result.traceback
    assert "the memory cgroup" in result.message and "384.0 MiB" in result.message
    assert "needs about" in result.message and "container's memory limit" in result.message
    assert result.leftover_pids == []


@pytest.mark.slow
def test_a_memory_cgroup_large_enough_runs_normally():
    with memory_cgroup(384 << 20) as wrap:
        if wrap is None:
            pytest.skip("no memory cgroup can be made here (needs root and a memory controller)")
        result = run_fault(LARGE.format(mib=1), wrap=wrap, timeout=120)  # 8 MiB batches
    assert result.returncode == 0 and result.type is None, result.traceback


@pytest.mark.slow
def test_an_address_space_limit_gives_shared_memory_error():
    scenario = '''
import resource
''' + LARGE.format(mib=64) + '''
_run = run
def run(report):
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.RLIM_INFINITY))
    _run(report)
'''
    result = run_fault(scenario, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.type == "SharedMemoryError", result.traceback
    assert "RLIMIT_AS" in result.message
