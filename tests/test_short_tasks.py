"""Short tasks: workers hold more of them, and the pool's I/O thread stops preempting them.

Seen from outside the engine: the scheduling policy of the process's threads (what
``ps -eLo tid,cls`` shows: ``B`` for ``SCHED_BATCH``), the default prefetch, and the
batches themselves. No timing is asserted: each test waits for what it expects, with a
deadline that only a broken feature reaches.
"""

import os
import re
import sys
import time

import numpy as np
import pytest

from extsrc import ParallelSource, WorkerPool
from faultkit import run_isolated
from sources import sample_of
from extsrc.engine import policy
from extsrc.shm import limits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "SCHED_BATCH"),
                                reason="thread scheduling policies are Linux's")

DEADLINE_S = 120.0  # generous: only a broken feature waits this long
LONG_TASK_S = 0.05  # a task this long is long on any machine (the pool's cover is 4 ms)


def deferring_threads() -> int:
    """How many threads of this process run under ``SCHED_BATCH``."""
    count = 0
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            if os.sched_getscheduler(int(task)) == os.SCHED_BATCH:
                count += 1
        except OSError:
            continue  # the thread ended meanwhile
    return count


def tiny(info):
    return np.full(8, info.idx_in_epoch & 0xFF, np.uint8)


def slow(info):
    time.sleep(LONG_TASK_S)
    return np.full(8, info.idx_in_epoch & 0xFF, np.uint8)


def consume_until(batches, expected_first, condition):
    """Takes batches (checking each one's first sample) until ``condition()``; how many."""
    deadline = time.monotonic() + DEADLINE_S
    taken = 0
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        batch = next(batches)
        assert int(batch[0][0]) == expected_first(taken) & 0xFF, f"batch {taken} is not in its place"
        taken += 1
    return taken


def check_policies() -> None:
    """In a fresh interpreter (no thread of another test): the pool's I/O thread defers
    while its tasks are short, and no thread does with long tasks or after the close."""
    assert deferring_threads() == 0
    with ParallelSource(tiny, 4, num_workers=2, start_method="fork") as fast:
        batches = iter(fast)
        taken = consume_until(batches, lambda k: 4 * k, lambda: deferring_threads() == 1)
        # Batches keep coming, each once and in order, while it defers.
        for k in range(taken, taken + 200):
            assert int(next(batches)[0][0]) == (4 * k) & 0xFF
    # The I/O thread ended with the source's pool (its task may outlive the join by a moment).
    deadline = time.monotonic() + DEADLINE_S
    while deferring_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deferring_threads() == 0
    # A source whose tasks take long never makes its I/O thread defer.
    with ParallelSource(slow, 1, num_workers=2, start_method="fork") as long_tasks:
        batches = iter(long_tasks)
        for k in range(12):
            assert int(next(batches)[0][0]) == k
            assert deferring_threads() == 0
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread never changes


def check_real_time_caller() -> None:
    """A program under chrt: its threads are real-time, and the I/O thread stays so (as
    SCHED_BATCH it would starve behind real-time workers)."""
    assert os.sched_getscheduler(0) == os.SCHED_RR
    with ParallelSource(tiny, 4, num_workers=1, start_method="fork") as source:
        batches = iter(source)
        for k in range(300):
            assert int(next(batches)[0][0]) == (4 * k) & 0xFF
        assert deferring_threads() == 0


def run_check(name: str) -> None:
    done = run_isolated(f"""
        import test_short_tasks
        test_short_tasks.{name}()
        print("checked")
    """, timeout=DEADLINE_S + 60)
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-3000:]


def test_the_io_thread_defers_while_tasks_are_short_and_not_with_long_ones():
    run_check("check_policies")


def test_a_real_time_caller_keeps_its_policy_for_the_io_thread():
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))  # inherited by the script
    except PermissionError:
        pytest.skip("setting a real-time policy needs CAP_SYS_NICE")
    try:
        run_check("check_real_time_caller")
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def test_small_batches_go_ahead_within_the_memory_bound():
    # Three workers, batches of exactly 1 MiB: the widened prefetch (three workers, two each,
    # times the factor) would be 36 MiB of batches ahead; it stops at the bound. It widens once
    # the pool has timed the source's tasks as short: the test takes batches until then.
    bound = policy.SMALL_AHEAD_BYTES // (1 << 20)  # the documented bound, in batches of 1 MiB
    if policy.small_batch_prefetch(2 * 3, 1 << 20, 2, 3, None, None) <= bound:
        pytest.skip("the policy widens three workers' prefetch less than the bound: nothing to bound")
    if policy.small_batch_prefetch(2 * 3, 1 << 20, 2, 3, limits.descriptor_limit(), None) < bound:
        pytest.skip("a descriptor limit this low bounds the prefetch first")
    sample = np.zeros(256 << 10, np.uint8)
    with ParallelSource(lambda info: sample, 4, num_workers=3, start_method="fork") as source:
        batches = iter(source)
        deadline = time.monotonic() + DEADLINE_S
        while source.prefetch == 2 * 3:
            assert time.monotonic() < deadline, "the prefetch never widened"
            next(batches)
        assert 2 * 3 < source.prefetch <= bound


ADDRESS_SPACE_SCRIPT = '''
import os, resource, time
import numpy as np
import extsrc

SAMPLE = 256 << 10  # four make a batch of 1 MiB: a small one
ROOM = 24 << 20  # room for the default prefetch's slots (and the first batches' mappings)

def sample(info):
    if info.idx_in_epoch < 8:
        time.sleep(0.5)  # the first two batches: the limit is set before the layout is known
    return np.full(SAMPLE, info.idx_in_epoch & 0xFF, np.uint8)

def vm_size():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmSize:"))

with extsrc.ParallelSource(sample, 4, num_workers=2, start_method="fork",
                           order=extsrc.Order(4 * 300)) as source:
    batches = iter(source)  # the workers and the pool's thread run: set the limit now (ulimit -v)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + ROOM, resource.RLIM_INFINITY))
    for k, batch in enumerate(batches):
        assert int(batch[0][0]) == (4 * k) & 0xFF and int(batch[3][-1]) == (4 * k + 3) & 0xFF, k
    assert k == 299, k
    print("PREFETCH", source.prefetch, flush=True)
'''


@pytest.mark.slow
def test_small_batches_go_ahead_only_as_far_as_the_address_space_allows():
    # Under ulimit -v with room for the default prefetch only, the widened prefetch would map
    # more slots than the room holds, and the consumer's own next batch would find none left.
    done = run_isolated(ADDRESS_SPACE_SCRIPT, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    prefetch = int(done.stdout.split()[-1])
    assert 2 * 2 <= prefetch < policy.small_batch_prefetch(2 * 2, 1 << 20, 2, 2, None, None)


def check_batch(batch, first: int) -> None:
    """The batch's samples (``sample_of``'s) are ``first, first + 1, ...``, each once."""
    got = [int(sample[0]) for sample in batch]
    assert got == list(range(first, first + len(got))), f"samples from {first} out of place"


def test_a_given_small_prefetch_cuts_only_batches_that_take_long():
    # prefetch=2 with two workers: a batch is cut in two, so that each worker has a task queued
    # behind its running one, until the pool has timed the source's batches; one a worker makes
    # in under WHOLE_BATCH_S then goes whole to one worker (an answer and a wake-up of the
    # pool's thread fewer per batch).
    short, long = policy.WHOLE_BATCH_S / 2, policy.WHOLE_BATCH_S * 3
    assert policy.task_ranges(256, 2, 2, 0.0) == 2  # not timed yet
    assert policy.task_ranges(256, 2, 2, short) == 1
    assert policy.task_ranges(256, 2, 2, long) == 2
    assert (policy.task_ranges(256, 8, 2, short), policy.task_ranges(256, 8, 2, long)) == (4, 8)
    assert policy.task_ranges(256, 2, 4, long) == 1  # the default prefetch: never cut
    assert policy.task_ranges(3, 8, 1, long) == 3  # never more tasks than samples


def slow_then_fast(info):
    if info.idx_in_epoch < 8 * 4:
        time.sleep(LONG_TASK_S / 8)  # batches of 8 as long as a long task
    return sample_of(info)


def fast_then_slow(info):
    if info.idx_in_epoch >= 8 * 300:
        time.sleep(LONG_TASK_S / 8)
    return sample_of(info)


@pytest.mark.parametrize("callback", [slow_then_fast, fast_then_slow])
def test_batches_stay_whole_and_in_order_while_their_cut_changes(callback):
    # Each source's batches change from long to short or back: the pool cuts them anew (see
    # above) while batches of the old cut are still being made.
    with ParallelSource(callback, 8, num_workers=2, start_method="fork", prefetch=2) as source:
        for k, batch in zip(range(320), source):
            check_batch(batch, 8 * k)


def test_on_a_shared_pool_only_the_source_with_short_tasks_goes_further_ahead():
    # Both sources' batches are small; one's tasks take long. Were it widened too (or its
    # tasks queued 8 deep in a worker because the other's are short), the short source's next
    # batch would wait behind a worker's queue of long tasks.
    from extsrc import WorkerPool

    pool = WorkerPool(2, start_method="fork")
    short_source = ParallelSource(tiny, 4, pool=pool)
    long_source = ParallelSource(slow, 1, pool=pool)
    try:
        fast_batches, slow_batches = iter(short_source), iter(long_source)
        taken, widened = 0, False
        deadline = time.monotonic() + DEADLINE_S
        for k in range(8):
            assert int(next(slow_batches)[0][0]) == k
            assert long_source.prefetch == 2 * 2
            for _ in range(50):
                assert int(next(fast_batches)[0][0]) == (4 * taken) & 0xFF
                taken += 1
                widened = widened or short_source.prefetch > 2 * 2
        # The short source widens once its tasks were timed short (on a busy machine a
        # preempted task may count as long for a while).
        while not widened:
            assert time.monotonic() < deadline, "the short source never went further ahead"
            assert int(next(fast_batches)[0][0]) == (4 * taken) & 0xFF
            taken += 1
            widened = short_source.prefetch > 2 * 2
        assert long_source.prefetch == 2 * 2
    finally:
        short_source.close()
        long_source.close()
        pool.close()


def sleeps_a_quarter(info):
    time.sleep(0.25)
    return np.zeros(4)


def returns_at_once(info):
    return np.zeros(4)


def test_on_a_shared_pool_a_quick_source_is_not_queued_behind_all_of_a_slow_ones_tasks():
    # The slow source goes 24 batches ahead (6 s of tasks on the one worker). Queued first in
    # first out, the quick source's next task waited behind all of them and its timeout fired
    # saying "no task was running"; the sources are now served in turn.
    with WorkerPool(1) as pool:
        slow = ParallelSource(sleeps_a_quarter, 1, pool=pool, name="slow", prefetch=24)
        quick = ParallelSource(returns_at_once, 1, pool=pool, name="quick", prefetch=1, timeout=3)
        slow.start()
        batches = iter(quick)
        for _ in range(4):
            next(batches)
        slow.close()
        quick.close()


def turns_long(info):
    time.sleep(0.0002 if info.iteration < 30 else 1.5)
    return np.zeros(4)


def test_a_timeout_names_the_other_sources_tasks_a_worker_holds_ahead():
    # Once the slow source's tasks turn long, the worker always holds one of them running and
    # at least one more queued (two per worker at least): the quick source's next task waits
    # behind a whole 1.5 s task, past its timeout, and the error says what it waited behind (it
    # said "no task was running").
    from extsrc import SourceTimeoutError

    with WorkerPool(1) as pool:
        slow = ParallelSource(turns_long, 1, pool=pool, name="slow")
        quick = ParallelSource(returns_at_once, 1, pool=pool, name="quick", timeout=1)
        batches = iter(slow)
        for _ in range(31):
            next(batches)
        with pytest.raises(SourceTimeoutError, match=r"of source quick was not ready") as caught:
            for _, _ in zip(range(100), iter(quick)):  # bounded: no hang if it never came
                pass
        assert re.search(r"Other sources' tasks ahead of it: worker 0 \(pid \d+\): \d+ task\(s\) of "
                         r"source slow, the first running for", str(caught.value)), str(caught.value)
