"""End of epoch: StopIteration from the callback, with the drop and partial policies."""

import pytest

from extsrc import EmptyEpochError, ParallelSource

from sources import StopsAt


@pytest.mark.parametrize("workers", [1, 2])
def test_drop_drops_the_batch_where_stop_iteration_came(workers):
    with ParallelSource(StopsAt(21), 8, num_workers=workers) as src:
        for _ in range(2):
            sizes = [len(b) for b in src]
            assert sizes == [8, 8]


@pytest.mark.parametrize("workers", [1, 2])
def test_partial_returns_the_samples_before_the_stop(workers):
    with ParallelSource(StopsAt(21), 8, num_workers=workers, last_batch="partial") as src:
        for _ in range(2):
            batches = list(src)
            assert [len(b) for b in batches] == [8, 8, 5]
            assert [int(s[0]) for s in batches[-1]] == [16, 17, 18, 19, 20]


def test_partial_with_an_exact_multiple_has_no_empty_batch():
    with ParallelSource(StopsAt(16), 8, last_batch="partial", num_workers=2) as src:
        assert [len(b) for b in src] == [8, 8]


def test_epoch_ending_in_the_first_batch():
    with ParallelSource(StopsAt(3), 8, last_batch="partial") as src:
        assert [len(b) for b in src] == [3]
    with ParallelSource(StopsAt(3), 8) as src:  # "drop" would leave nothing: said, not silent
        with pytest.raises(EmptyEpochError, match=r"ended after 3 samples.*batch_size=8.*last_batch='partial'"):
            list(src)


def test_batch_mode_epoch_ends_on_stop_iteration():
    def source(iteration):
        if iteration == 3:
            raise StopIteration
        return [iteration] * 2

    with ParallelSource(source, 2, batch=True, num_workers=2) as src:
        assert [int(b[0]) for b in src] == [0, 1, 2]
        assert [int(b[0]) for b in src] == [0, 1, 2]
