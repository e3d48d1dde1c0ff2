"""worker_restarts=: a worker that dies is replaced, its tasks redone; no batch is lost, repeated
or reordered; past the budget the pool breaks with WorkerDiedError, as without restarts."""

import logging

import numpy as np
import pytest

from extsrc import ParallelSource, PoolSpec, WorkerDiedError, WorkerPool

from procs import live_children
from sources import KillsItsWorker


def _marks(tmp_path, count):
    for k in range(count):
        (tmp_path / f"kill-{k}").touch()
    return str(tmp_path)


def _records(source):
    return [int(sample[0]) for batch in source for sample in batch]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("in_order", [True, False])
def test_a_worker_killed_mid_task_is_replaced_and_the_epoch_is_whole(tmp_path, caplog,
                                                                     start_method, in_order):
    pool = WorkerPool(2, start_method=start_method, worker_restarts=1)
    with pool, ParallelSource(KillsItsWorker(400, 123, _marks(tmp_path, 1)), 8, pool=pool,
                              in_order=in_order) as source:
        with caplog.at_level(logging.WARNING, logger="extsrc"):
            got = _records(source)
        assert (got if in_order else sorted(got)) == list(range(400))
        assert len(pool.restarts) == 1 and "SIGKILL" in pool.restarts[0]
        assert "a new worker took its place" in caplog.text
        assert source.stats().worker_restarts == 1
        assert _records(source) == list(range(400)) or not in_order  # and the next epoch
        assert len(source.worker_pids()) == 2


def test_a_second_death_past_the_budget_raises_as_without_restarts(tmp_path):
    before = set(live_children())  # others' (a local Ray of earlier tests) stay
    pool = WorkerPool(2, worker_restarts=1)
    with pool, ParallelSource(KillsItsWorker(64, 20, _marks(tmp_path, 2)), 8, pool=pool) as source:
        with pytest.raises(WorkerDiedError, match="SIGKILL") as raised:
            _records(source)
        assert "replaced 1 lost worker" in "\n".join(getattr(raised.value, "__notes__", []))
    assert set(live_children()) - before == set()  # every worker, lost or not, is gone


def test_a_callback_that_kills_every_worker_ends_with_an_error():
    before = set(live_children())
    pool = WorkerPool(2, worker_restarts=3)
    with pool, ParallelSource(KillsItsWorker(64, 5), 8, pool=pool) as source:
        with pytest.raises(WorkerDiedError):
            _records(source)
        assert len(pool.restarts) == 3
    assert set(live_children()) - before == set()  # every worker, lost or not, is gone


def test_the_workers_of_an_iterable_are_not_replaced():
    def batches():
        import os
        import signal

        yield np.zeros((2, 2))
        os.kill(os.getpid(), signal.SIGKILL)

    pool = WorkerPool(1, worker_restarts=2)
    with pool, ParallelSource(batches, 2, batch=True, pool=pool) as source:
        with pytest.raises(WorkerDiedError):
            list(source)  # its position in the stream died with it: redoing would repeat
        assert pool.restarts == []


def test_worker_restarts_is_checked():
    with pytest.raises(ValueError, match="worker_restarts must be an int >= 0"):
        WorkerPool(2, worker_restarts=-1)
    with pytest.raises(ValueError, match="worker_restarts must be an int >= 0"):
        WorkerPool(2, worker_restarts=True)


def test_a_source_that_owns_its_pool_takes_worker_restarts(tmp_path):
    spec = PoolSpec(num_workers=2, worker_restarts=1)
    with ParallelSource(KillsItsWorker(96, 40, _marks(tmp_path, 1)), 8, pool=spec) as source:
        assert _records(source) == list(range(96))
        assert source.pool.restarts and source.stats().worker_restarts == 1
    with pytest.raises(ValueError, match="num_workers come.* from pool= .*give them in the pool"):
        ParallelSource(KillsItsWorker(8, 99), 4, num_workers=2, pool=PoolSpec(worker_restarts=1))


@pytest.mark.parametrize("at", [45, 46])
def test_a_new_worker_keeps_the_lost_ones_samples_of_a_batch_being_filled(tmp_path, at):
    # The lost worker wrote ragged samples of a batch (its other task) into its overflow; the
    # new one, redoing the task it held, wrote over them (records 42-43 read 46-47's values).
    from sources import RaggedKillsAt

    pool = WorkerPool(2, worker_restarts=1)
    with pool, ParallelSource(RaggedKillsAt(96, at, _marks(tmp_path, 1)), 8, pool=pool,
                              prefetch=1) as source:
        samples = [sample.tolist() for batch in source for sample in batch]
        assert len(pool.restarts) == 1
    assert samples == [[r] * (1 + r % 5) for r in range(96)]
