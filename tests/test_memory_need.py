"""A request no memory limit allows fails at the first sample, with nothing reserved.

The source knows at its first sample what it will need in all (the sample's
size, the batch size, the slots it keeps); a request beyond every limit is a
``SharedMemoryError`` at once, not after reserving what the limits allow.
Each case runs in its own interpreter with a time limit (a hang guard).
"""

import pytest

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
