"""Which worker makes which batch: as a DataLoader, batch i of every epoch is made whole by
worker i % num_workers (a dataset that keeps per-worker state, or checks the worker id of a
batch, sees the DataLoader's assignment)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, SequentialSampler, get_worker_info

from extsrc.torch import from_dataset


class WorkerTagged(Dataset):
    """Each sample is (the id of the worker that loaded it, its index)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int):
        info = get_worker_info()
        return torch.tensor(-1 if info is None else info.id), torch.tensor(index)


def _check_round_robin(loader, num_workers: int, batch_size: int, epochs: int = 2) -> None:
    for _ in range(epochs):
        count = 0
        for i, (workers, indices) in enumerate(loader):
            assert workers.tolist() == [i % num_workers] * len(workers), f"batch {i}"
            assert indices.tolist() == list(range(i * batch_size, min((i + 1) * batch_size, 40)))
            count += 1
        assert count == -(-40 // batch_size)


@pytest.mark.filterwarnings("ignore:from_dataset starts 3 worker processes")
def test_each_batch_is_made_whole_by_worker_i_mod_num_workers():
    with from_dataset(WorkerTagged(), batch_size=6, num_workers=3) as loader:
        _check_round_robin(loader, 3, 6)


def test_round_robin_with_a_collate_fn_and_with_a_sampler():
    def stacked(samples):
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    with from_dataset(WorkerTagged(), batch_size=4, num_workers=2, collate_fn=stacked) as loader:
        _check_round_robin(loader, 2, 4)
    dataset = WorkerTagged()
    with from_dataset(dataset, batch_size=5, num_workers=2,
                      sampler=SequentialSampler(dataset)) as loader:
        _check_round_robin(loader, 2, 5)


def test_a_dataset_with_per_worker_state_sees_its_batches_in_order():
    # A dataset that remembers, in each worker, the last index it loaded: with DataLoader's
    # assignment, every worker loads whole batches, so consecutive indices within a batch.
    class Stateful(Dataset):
        last = None

        def __len__(self):
            return 32

        def __getitem__(self, index):
            previous, self.last = self.last, index
            return torch.tensor(-1 if previous is None else previous)

    with from_dataset(Stateful(), batch_size=8, num_workers=2) as loader:
        for i, previous in enumerate(loader):
            expected = list(range(i * 8 - 1, i * 8 + 7))
            # Each worker's first sample of a batch follows its own previous batch (i - 2).
            expected[0] = -1 if i < 2 else (i - 2) * 8 + 7
            assert previous.tolist() == expected, f"batch {i}"
