"""Starting, closing and exiting: no hang, no noise, nothing left behind."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from extsrc import ParallelSource, PoolClosedError, WorkerPool

from faultkit import run_isolated
from procs import named_shm_in_use, own_shm_entries
from sources import pid_sample, sample_of


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def held_files(pid):
    """What the process's descriptors point at."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return targets


def worker_pids(src):
    return src.worker_pids()


def test_start_starts_workers_before_first_use_and_close_stops_them():
    src = ParallelSource(sample_of, 2, num_workers=2)
    src.start()
    pids = worker_pids(src)
    assert len(pids) == 2 and all(alive(p) for p in pids)
    src.close()
    assert not any(alive(p) for p in pids)


def test_close_twice_and_iteration_after_close():
    src = ParallelSource(sample_of, 2)
    next(iter(src))
    src.close()
    src.close()
    with pytest.raises(PoolClosedError, match="closed"):
        iter(src)


def test_close_during_iteration_ends_the_loop_quietly():
    src = ParallelSource(sample_of, 2, num_workers=2)
    seen = 0
    for _ in src:
        seen += 1
        if seen == 3:
            src.close()
    assert seen == 3


def test_breaking_out_of_an_epoch_then_starting_another():
    with ParallelSource(sample_of, 4, num_workers=2) as src:
        for i, _ in enumerate(src):
            if i == 2:
                break
        batch = next(iter(src))
        assert [int(s[3]) for s in batch] == [1] * 4 and int(batch[0][0]) == 0


def test_new_epoch_waits_for_slots_still_busy_with_the_abandoned_one():
    def slow(info):
        time.sleep(0.05)
        return np.array([info.epoch_idx, info.idx_in_epoch])

    with ParallelSource(slow, 1, num_workers=2) as src:
        for epoch in range(3):
            it = iter(src)
            assert next(it)[0].tolist() == [epoch, 0]


def test_samples_are_never_named_in_dev_shm():
    with ParallelSource(sample_of, 4, num_workers=2) as src:
        it = iter(src)
        batches = [next(it) for _ in range(3)]
        mine = [os.getpid()] + src.worker_pids()
        assert named_shm_in_use(mine) == [] and own_shm_entries(mine) == set()
        assert int(batches[-1][0][0]) == 8


def test_dev_shm_backend_unlinks_at_once(monkeypatch):
    monkeypatch.setenv("EXTSRC_SHM_BACKEND", "devshm")
    with ParallelSource(sample_of, 4, num_workers=2) as src:
        it = iter(src)
        batches = [next(it) for _ in range(3)]
        mine = [os.getpid()] + src.worker_pids()
        assert named_shm_in_use(mine) == [] and own_shm_entries(mine) == set()
        assert any(target.startswith("/dev/shm/") for target in held_files(os.getpid())), \
            "the devshm backend was not used"
        assert int(batches[-1][0][0]) == 8


def test_shared_pool_serves_several_sources():
    pool = WorkerPool(num_workers=2)
    a = ParallelSource(sample_of, 2, pool=pool)
    b = ParallelSource(lambda info: np.array([-info.idx_in_epoch]), 3, pool=pool)
    pool.start()
    ia, ib = iter(a), iter(b)
    assert [int(s[0]) for s in next(ia)] == [0, 1]
    assert [int(s[0]) for s in next(ib)] == [0, -1, -2]
    assert [int(s[0]) for s in next(ia)] == [2, 3]
    pool.close()
    with pytest.raises(PoolClosedError):
        iter(b)


def test_workers_really_run_in_parallel_processes():
    with ParallelSource(pid_sample, 8, num_workers=2) as src:
        it = iter(src)
        pids = {int(s[0]) for _ in range(4) for s in next(it)}
    assert os.getpid() not in pids and len(pids) == 2


def run_script(code, timeout=60):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def test_interpreter_exit_with_a_live_source_is_quiet_and_leaves_no_worker():
    out = run_script(
        """
        import numpy as np, extsrc
        src = extsrc.ParallelSource(lambda i: np.zeros(4), 8, num_workers=2)
        next(iter(src))
        print(*src.worker_pids())
        """
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    time.sleep(0.2)
    assert not any(alive(int(p)) for p in out.stdout.split())


DATASET_AT_EXIT = """
import numpy as np, torch
{held}
from extsrc.torch import from_dataset

class Records(torch.utils.data.Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        return {sample}

loader = from_dataset(Records(), batch_size=8, num_workers=2)
batches = iter(loader)
next(batches)
print(*loader.source.worker_pids())
{end}
"""


@pytest.mark.parametrize("held, sample, end", [
    ("", '{"x": torch.zeros(3), "y": i}', ""),  # the loader live at exit
    # closed before, the script holding an engine module (whose names are cleared later)
    ("from extsrc.engine import pool", "np.zeros(4)", "loader.close()"),
], ids=["live", "closed"])
def test_interpreter_exit_with_a_dataset_loader_is_quiet_and_leaves_no_worker(held, sample, end):
    # The loop's objects go after the modules' names were cleared at exit: their __del__ and
    # the collected source's callback must not look a module name up then ("Exception ignored
    # in ... 'NoneType' object is not callable", "... has no attribute 'get_ident'").
    pytest.importorskip("torch")
    out = run_script(DATASET_AT_EXIT.format(held=held, sample=sample, end=end))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    time.sleep(0.2)
    assert not any(alive(int(p)) for p in out.stdout.split())


def test_workers_exit_when_the_parent_is_killed():
    out = run_script(
        """
        import os, signal, sys, time, numpy as np, extsrc
        def slow(info):
            time.sleep(0.2)
            return np.zeros(4)
        src = extsrc.ParallelSource(slow, 8, num_workers=2)
        it = iter(src)
        print(*src.worker_pids(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert out.returncode == -signal.SIGKILL
    pids = [int(p) for p in out.stdout.split()]
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_close_gives_back_every_descriptor_thread_and_process_at_once(method):
    # Closed sources kept in a list, the garbage collector off: whatever close() does not give
    # back stays held (500 such sources once exhausted the default 1,024 descriptors).
    out = run_isolated(
        f"""
        import _thread, gc, json, os
        import numpy as np
        import extsrc
        from procs import live_children
        from sources import sample_of

        def fails(info):
            if info.idx_in_epoch == 5:
                raise ValueError("bad sample")
            return np.zeros(3)

        def counts():
            return (len(os.listdir("/proc/self/fd")), _thread._count(), len(live_children()))

        def use(kept):
            src = extsrc.ParallelSource(sample_of, 4, num_workers=2, start_method="{method}")
            for i, batch in enumerate(src):
                if i == 2:
                    break
            del batch
            src.close()
            kept.append(src)
            pool = extsrc.WorkerPool(2, start_method="{method}")
            a = extsrc.ParallelSource(sample_of, 4, pool=pool)
            b = extsrc.ParallelSource(fails, 4, pool=pool)
            next(iter(a))
            try:
                list(b)
            except ValueError:
                pass
            a.close()
            b.close()
            pool.close()
            kept += [a, b, pool]

        if __name__ == "__main__":
            gc.disable()
            kept = []
            use(kept)  # multiprocessing's helpers (fork server, resource tracker) live on
            before = counts()
            for _ in range(5):
                use(kept)
            print("COUNTS", json.dumps([before, counts()]))
        """
    )
    line = next((text for text in out.stdout.splitlines() if text.startswith("COUNTS")), None)
    assert line is not None, out.stderr
    before, after = json.loads(line[len("COUNTS"):])
    assert after == before, f"(descriptors, threads, children) after close(): {after}, before: {before}"
