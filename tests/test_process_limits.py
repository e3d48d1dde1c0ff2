"""Running out of descriptors or address space: a clear error from the call that needed them, and
a source opened before goes on. Each case runs in its own interpreter with a time limit.
"""

import json

import pytest

from faultkit import run_isolated

pytestmark = pytest.mark.slow

# A working source first; then the limit is set just above what is in use, a little higher on
# each round, so that each step that needs a resource (starting workers, a slot, a mapping, the
# I/O thread) is the one that runs out on some round. What each round saw is printed as JSON.
SCRIPT = '''
import errno, json, os, resource, sys
import numpy as np
import extsrc

METHOD = "{method}"

def small(info):
    return np.full(4, info.idx_in_epoch, np.int64)

def large(info):
    return np.full({sample_mib} << 20, info.idx_in_epoch % 251, np.uint8)

def in_use():
    if "{limit}" == "RLIMIT_NOFILE":
        return len(os.listdir("/proc/self/fd"))
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmSize:"))

if __name__ == "__main__":
    first = extsrc.ParallelSource(small, 4, num_workers=2, start_method=METHOD)
    it = iter(first)
    expected = 0
    assert next(it)[0][0] == expected
    limit = getattr(resource, "{limit}")
    hard = resource.getrlimit(limit)[1]
    for extra in {extras}:
        resource.setrlimit(limit, (in_use() + extra, hard))
        seen = None
        second = extsrc.ParallelSource(large, 4, num_workers=2, start_method=METHOD, prefetch=8)
        try:
            for i, batch in enumerate(second):
                if i == 3:
                    break
            del batch
        except BaseException as exc:
            seen = [type(exc).__name__, isinstance(exc, OSError), str(exc)]
        finally:
            second.close()
            resource.setrlimit(limit, (hard, hard))
        first_ok = True
        for _ in range(3):  # the source opened before goes on
            expected += 4
            batch = next(it)
            first_ok = first_ok and int(batch[0][0]) == expected
        print("ROUND " + json.dumps([extra, seen, first_ok]), flush=True)
'''


def rounds(out):
    found = [json.loads(line[len("ROUND "):]) for line in out.stdout.splitlines() if line.startswith("ROUND ")]
    assert found, f"no round finished (rc {out.returncode}):\n{out.stderr[-3000:]}"
    return found


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_out_of_descriptors_is_an_os_error_naming_the_limit_and_spares_the_sources_before(method):
    code = SCRIPT.format(method=method, limit="RLIMIT_NOFILE", sample_mib=0,
                         extras=list(range(1, 60, 3)))
    out = run_isolated(code, timeout=240)
    results = rounds(out)
    errors = [seen for _extra, seen, _ok in results if seen is not None]
    assert errors, "no round ran out of descriptors"
    for extra, seen, first_ok in results:
        assert first_ok, f"with {extra} descriptors to spare, the source opened before broke"
        if seen is not None:
            name, is_os_error, message = seen
            assert is_os_error and name in ("OSError", "SharedMemoryError"), seen
            assert "RLIMIT_NOFILE" in message and "ulimit -n" in message, message
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_out_of_address_space_is_an_os_error_naming_the_limit_and_spares_the_sources_before():
    code = SCRIPT.format(method="fork", limit="RLIMIT_AS", sample_mib=8,
                         extras=[m << 20 for m in (1, 4, 12, 40, 100, 200)])
    out = run_isolated(code, timeout=240)
    results = rounds(out)
    errors = [seen for _extra, seen, _ok in results if seen is not None]
    assert errors, "no round ran out of address space"
    for extra, seen, first_ok in results:
        assert first_ok, f"with {extra >> 20} MiB of address space to spare, the source opened before broke"
        if seen is not None:
            name, is_os_error, message = seen
            assert is_os_error and name in ("OSError", "SharedMemoryError"), seen
            assert "RLIMIT_AS" in message and "ulimit -v" in message, message
    assert out.returncode == 0, out.stderr[-3000:]


COPY_SCRIPT = '''
import json, resource
import numpy as np
import extsrc

def large(info):
    return np.full(8 << 20, info.idx_in_epoch % 251, np.uint8)

def vm_size():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmSize:"))

if __name__ == "__main__":
    for mib in range(32, 260, 16):
        src = extsrc.ParallelSource(large, 8, num_workers=2, prefetch=1, batches_held=1)
        src.start()
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (mib << 20), resource.RLIM_INFINITY))
        seen, right = None, True
        try:
            for i, batch in enumerate(src):
                right = right and batch.is_dense and int(batch[3][0]) == (i * 8 + 3) % 251
                if i == 2:
                    break
            del batch
        except BaseException as exc:
            seen = [type(exc).__name__, str(exc)]
        finally:
            src.close()
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print("ROUND " + json.dumps([mib, seen, right]), flush=True)
'''


def test_the_dense_copy_of_a_first_batch_is_checked_against_the_address_space_limit():
    # The first batch's uniform output is written apart by the workers and copied into one
    # dense array (64 MiB here); under ulimit -v that copy must fail as SharedMemoryError
    # naming itself and the limit, not as NumPy's bare MemoryError.
    out = run_isolated(COPY_SCRIPT, timeout=240)
    results = rounds(out)
    assert any(seen is None for _mib, seen, _right in results), "no round had room enough"
    for mib, seen, right in results:
        assert right, f"with {mib} MiB to spare, a batch was wrong or not dense"
        if seen is not None:
            assert seen[0] == "SharedMemoryError" and "RLIMIT_AS" in seen[1], (mib, seen)
    assert any(seen is not None and "dense copy" in seen[1] for _mib, seen, _right in results)


NO_MEMORY = '''
import extsrc
from extsrc.engine import pool as pool_module
from extsrc.engine.processes import ProcessBackend
from extsrc.errors import InternalError
from script_helpers import eight

if __name__ == "__main__":
    src = extsrc.ParallelSource(eight, 2, num_workers=1)
    stop = ProcessBackend.stop

    def receive(self, events):
        raise MemoryError()

    def no_memory(*args, **kwargs):
        raise MemoryError()

    def stop_then_fail(self, ask):
        stop(self, ask)
        raise MemoryError()

    # The I/O thread runs out of memory, then again while it describes that and stops the workers.
    ProcessBackend.receive, ProcessBackend.stop = receive, stop_then_fail
    pool_module.InternalError = no_memory
    try:
        list(src)
    except InternalError as exc:
        print("RAISED", "no memory left" in str(exc))
    ProcessBackend.stop = stop
    src.close()
'''


def test_an_io_thread_out_of_memory_even_for_its_error_breaks_the_pool_instead_of_hanging():
    # Under `ulimit -v` the pool's I/O thread may get a MemoryError, and another while it builds
    # the error for the consumers or stops the workers: it then ended with the pool RUNNING and
    # nobody told, and next() waited for ever.
    result = run_isolated(NO_MEMORY, timeout=60)
    assert "RAISED True" in result.stdout, result.stdout + result.stderr[-3000:]


SILENT_END = '''
import os
import extsrc
from extsrc.engine.pool import WorkerPool
from extsrc.errors import InternalError
from script_helpers import eight

def ends_at_once(self, token):
    raise MemoryError()  # before it could tell anyone: no state set, no waiter woken

if __name__ == "__main__":
    WorkerPool._run = ends_at_once
    src = extsrc.ParallelSource(eight, 2, num_workers=1)
    try:
        list(src)
    except InternalError as exc:
        print("RAISED", "I/O thread" in str(exc))
    pids = src.pool.workers_backend.worker_pids()
    src.close()
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    print("WORKERS", len(pids), "ALIVE", len(alive))
'''


def test_a_consumer_waiting_on_an_io_thread_that_ended_without_a_word_gets_an_error():
    # Wherever the I/O thread ends (a MemoryError where nothing can be allocated to tell the
    # waiters), a consumer in next() finds it ended and raises instead of waiting for ever.
    result = run_isolated(SILENT_END, timeout=60)
    assert "RAISED True" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "WORKERS 1 ALIVE 0" in result.stdout, result.stdout  # close() stopped the worker


SILENT_END_UNORDERED = '''
import time
import torch
from extsrc.engine.pool import WorkerPool
from extsrc.errors import InternalError
from extsrc.torch import from_dataset

class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(8))

def ends_soon(self, token):
    time.sleep(1)  # the consumer waits by then
    raise MemoryError()

if __name__ == "__main__":
    WorkerPool._run = ends_soon
    loader = from_dataset(Stream(), batch_size=2, num_workers=2, in_order=False)
    try:
        list(loader)
    except InternalError as exc:
        print("RAISED", "I/O thread" in str(exc))
    loader.close()
'''


def test_an_unordered_iterable_loader_waiting_on_an_io_thread_that_ended_without_a_word_gets_an_error():
    pytest.importorskip("torch")  # the script's IterableDataset
    # from_dataset's IterableDataset loader with in_order=False waits for whichever worker's
    # batch comes first, on its own wait: it too finds the I/O thread ended (it hung).
    result = run_isolated(SILENT_END_UNORDERED, timeout=60)
    assert "RAISED True" in result.stdout, result.stdout + result.stderr[-3000:]
