"""A request no memory limit allows fails at the first sample, with nothing reserved.

The source knows at its first sample what it will need in all (the sample's
size, the batch size, the slots it keeps); a request beyond every limit is a
``SharedMemoryError`` at once, not after reserving what the limits allow.
Each case runs in its own interpreter with a time limit (a hang guard).
"""

import numpy as np
import pytest

import extsrc

from faultkit import run_fault, unshare_small_dev_shm

# One batch needs twice the machine's memory, whatever the machine. A sampler thread records the
# lowest MemAvailable and the consumer's peak RSS while the source runs; the workers' peak RSS
# comes from RUSAGE_CHILDREN once they are reaped by close().
IMPOSSIBLE = '''
import os, resource, threading, time
import numpy as np, extsrc

SAMPLE = 64 << 20

def meminfo(key):
    with open("/proc/meminfo") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith(key + ":"))

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmRSS:"))

def big(info):
    return np.full((SAMPLE,), info.idx_in_epoch % 256, np.uint8)

def run(report):
    batch_size = {batch_size}
    low = [meminfo("MemAvailable")]
    high = [rss()]
    before_available, before_rss = low[0], high[0]
    done = threading.Event()
    def sample():
        while not done.is_set():
            low[0] = min(low[0], meminfo("MemAvailable"))
            high[0] = max(high[0], rss())
            time.sleep(0.005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    src = extsrc.ParallelSource(big, batch_size, num_workers=2)
    try:
        src.start()
        report.pids(src.pool.worker_pids())
        report.fault_starts()
        next(iter(src))
    finally:
        src.close()
        done.set()
        sampler.join()
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss << 10
        print("FIGURES", before_available - low[0], high[0] - before_rss, children, flush=True)
'''


def _figures(result):
    line = next(text for text in result.stdout.splitlines() if text.startswith("FIGURES "))
    return [int(x) for x in line.split()[1:]]


def _check_nothing_taken(result):
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.type == "SharedMemoryError", result.traceback
    available_drop, consumer_rss_growth, worker_peak_rss = _figures(result)
    # Nothing taken: one 64 MiB sample was made, no batch memory reserved (before: 16 GiB
    # reserved over 111 s, sample by sample, until the limit).
    assert worker_peak_rss < 1 << 30, worker_peak_rss
    assert consumer_rss_growth < 256 << 20, consumer_rss_growth
    assert available_drop < 2 << 30, available_drop  # others' programs may take some meanwhile
    assert result.leftover_pids == []
    message = result.message
    assert "needs about" in message and "of shared memory" in message  # what is needed
    assert "batches of" in message and "64.0 MiB" in message  # how it was counted
    assert ("is left" in message or " free " in message) and "Nothing was reserved" in message
    return message


def test_a_batch_larger_than_the_machine_fails_at_once_with_nothing_taken():
    scenario = IMPOSSIBLE.replace("{batch_size}", '-(-2 * meminfo("MemTotal") // SAMPLE)')
    message = _check_nothing_taken(run_fault(scenario, timeout=60))
    assert "MemAvailable" in message or "cgroup" in message or "RLIMIT_AS" in message  # which limit
    assert "GiB of shared memory" in message
    assert "lower prefetch or the batch size" in message  # the advice


def test_a_small_dev_shm_is_named_with_dockers_shm_size_before_anything_is_taken():
    wrap = unshare_small_dev_shm("256m")
    if wrap is None:
        pytest.skip("no private /dev/shm can be mounted here (needs unshare and root)")
    scenario = IMPOSSIBLE.replace("{batch_size}", "8")  # 512 MiB batches, a 256 MiB /dev/shm
    result = run_fault(scenario, timeout=60, wrap=wrap, env={"EXTSRC_SHM_BACKEND": "devshm"})
    message = _check_nothing_taken(result)
    assert "/dev/shm has 256.0 MiB in all" in message and "Docker's --shm-size" in message
    assert "--shm-size=" in message  # the container advice


def _ragged_by_epoch(info):
    """Epoch 0: samples of about 4 MiB, epoch 1 and after: of about 4 KiB; each a little
    shorter than the one before in its batch (a ragged output), filled with its index."""
    if info.idx_in_epoch >= 32:
        raise StopIteration
    size = (4 << 20 if info.epoch_idx == 0 else 4 << 10) - 64 * info.idx_in_batch
    return np.full(size, info.idx_in_epoch & 0xFF, np.uint8)


def _epoch_checked(source):
    """Takes an epoch, checking each batch; returns the most shared memory held meanwhile."""
    peak = 0
    for k, batch in enumerate(source):
        assert [int(sample[0]) for sample in batch] == [(4 * k + j) & 0xFF for j in range(4)]
        assert all(int(sample[-1]) == int(sample[0]) for sample in batch)
        peak = max(peak, source.shared_memory_bytes())
    return peak


def _memory_after_large_then_small_epochs(watched):
    """The most shared memory held during an epoch of large samples, and what is held after
    two epochs of small ones. The peak, not the figure at the large epoch's end: how much of
    it is already given back by then depends on which worker wrote which slot."""
    with extsrc.ParallelSource(_ragged_by_epoch, 4, num_workers=2) as source:
        if watched:
            source.watch_memory(lambda address, size: None, lambda address, size: None)
        large = _epoch_checked(source)
        _epoch_checked(source)
        _epoch_checked(source)  # each slot written again since
        return large, source.shared_memory_bytes()


def test_ragged_samples_hold_memory_for_the_batches_of_now_not_the_largest_ever():
    # A ragged output goes to the workers' overflow segments, which only grew: after an epoch
    # of 4 MiB samples, an epoch of 4 KiB ones kept the memory of the large ones for good (and
    # epochs of changing sizes made it grow towards workers x the largest batch per slot).
    large, small = _memory_after_large_then_small_epochs(watched=False)
    assert large >= 16 << 20  # the slots held large batches (16 MiB each)
    assert small < large / 4, (small, large)
    # Memory page-locked for DMA (CUDA's cudaHostRegister, watch_memory) is never given back:
    # the registration keeps the pages it found, and memory given back and written again would
    # reach the GPU as the old pages' bytes.
    _, kept = _memory_after_large_then_small_epochs(watched=True)
    assert kept > 2 * small, (kept, small)
