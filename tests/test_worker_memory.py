"""A worker keeps the memory of samples it let go, to make the next ones without page faults.

The callback here does what an HTTP client does with samples in flight together: it
makes many 1 MiB buffers, fills them and lets them all go. Each sample is the number of
page faults the worker took while doing so. With glibc's defaults the freed memory goes
back to the kernel (mmap/munmap, or a trimmed heap) and every call faults all of it in
again; a worker of extsrc keeps it (:mod:`extsrc.engine.worker_malloc`).
"""

import resource

import numpy as np
import pytest

from extsrc import ParallelSource
from extsrc.engine import worker_malloc

MIB = 1 << 20
BUFFERS = 80  # 80 MiB freed at once: more than glibc ever keeps by itself (64 MiB)
PAGES = BUFFERS * MIB // resource.getpagesize()
WARM_UP_BATCHES = 2


def faults_making_buffers(info):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [bytearray(MIB) for _ in range(BUFFERS)]
    for buffer in buffers:
        buffer[::4096] = b"\x01" * len(buffer[::4096])  # one byte per page: every page used
    del buffers
    return np.array([resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before], np.int64)


@pytest.mark.skipif(not worker_malloc.available(), reason="the C library has no mallopt (not glibc)")
@pytest.mark.skipif(worker_malloc.user_chose(), reason="the environment sets glibc's thresholds")
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_samples_made_again_do_not_fault_their_memory_in_again(start_method):
    with ParallelSource(faults_making_buffers, batch_size=2, num_workers=1,
                        start_method=start_method, prefetch=1) as source:
        batches = iter(source)
        for _ in range(WARM_UP_BATCHES):
            next(batches)
        faults = [int(sample[0]) for _ in range(3) for sample in next(batches)]
    # glibc's defaults fault every page in again on each call (PAGES or more). The median:
    # the machine's own memory reclaim may take back some kept pages of one call (seen once:
    # 4,066 faults in one sample of six).
    assert sorted(faults)[len(faults) // 2] < PAGES // 10, (faults, PAGES)


def test_the_user_s_own_allocator_settings_are_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert worker_malloc.user_chose()
    assert worker_malloc.keep_freed_memory() is False  # nothing set in this process
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000")
    assert worker_malloc.user_chose()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.x86_rep_movsb_threshold=4096")
    assert not worker_malloc.user_chose()
