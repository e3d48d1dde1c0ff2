"""start() fills the next epoch's prefetch at once, so the first batch after a pause (a model
compiling) is ready without waiting; iter() takes what was filled, nothing is made twice."""

import os
import time

import pytest

from extsrc import Order, ParallelSource

from sources import MarksOnce, wait_for_files

BATCH = 4
PREFETCH = 3


def wait_until_ready(epoch, deadline_s=120):
    """Whether the epoch's next batch is ready (its next() would not wait) by the deadline."""
    deadline = time.monotonic() + deadline_s
    while not epoch.ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    return epoch.ready()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_first_batch_is_ready_after_start_and_a_pause(tmp_path, method):
    with ParallelSource(MarksOnce(str(tmp_path)), BATCH, num_workers=2, start_method=method,
                        prefetch=PREFETCH, order=Order(40)) as src:
        src.start()
        # The pause: the workers make the prefetch's batches meanwhile, before any iter().
        assert wait_for_files(str(tmp_path), BATCH * PREFETCH) >= BATCH * PREFETCH
        epoch = iter(src)
        assert wait_until_ready(epoch)  # its answers may still be on their way, not its work
        rows = [int(batch.as_array()[0, 0]) for batch in epoch]
    assert rows == [BATCH * k for k in range(10)]  # every batch once (a sample made twice fails)
    assert sorted(os.listdir(tmp_path)) == sorted(f"0-{i}" for i in range(40))


def test_a_state_set_to_where_start_fills_keeps_what_was_filled(tmp_path):
    # The DALI drop-in sets the state DALI asks for at its first run(): the same position.
    with ParallelSource(MarksOnce(str(tmp_path)), BATCH, num_workers=2, prefetch=PREFETCH,
                        order=Order(40)) as src:
        src.start()
        assert wait_for_files(str(tmp_path), BATCH * PREFETCH) >= BATCH * PREFETCH
        src.set_state(src.get_state())
        epoch = iter(src)
        assert wait_until_ready(epoch)
        assert [int(batch.as_array()[0, 0]) for batch in epoch] == [BATCH * k for k in range(10)]


def test_start_without_fill_starts_only_the_workers(tmp_path):
    with ParallelSource(MarksOnce(str(tmp_path)), BATCH, num_workers=2, order=Order(40)) as src:
        src.start(fill=False)
        assert len(src.worker_pids()) == 2
        time.sleep(0.5)  # not a timing assertion: time for work that must not happen
        assert os.listdir(tmp_path) == []
        assert len(list(src)) == 10


def test_a_state_elsewhere_drops_what_start_filled(tmp_path):
    with ParallelSource(MarksOnce(str(tmp_path)), BATCH, num_workers=2, prefetch=PREFETCH,
                        order=Order(40)) as src:
        src.start()
        assert wait_for_files(str(tmp_path), BATCH * PREFETCH) >= BATCH * PREFETCH
        src.set_state({"epoch_idx": 1, "iteration": 5})
        assert [int(batch.as_array()[0, 0]) for batch in src] == [BATCH * k for k in range(5, 10)]
