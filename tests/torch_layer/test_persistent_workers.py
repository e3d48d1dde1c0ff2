"""persistent_workers as DataLoader's: False (the default) gives each loop new workers (the
worker_init_fn runs again, the workers' copy of the dataset is fresh); True keeps them."""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset, SequentialSampler, get_worker_info

from extsrc.torch import from_dataset


class Counting(Dataset):
    """Each sample: (the pid of its worker, how many samples this copy of the dataset loaded
    before it, how many times worker_init_fn ran in the worker)."""

    def __init__(self):
        self.loaded = 0
        self.inits = 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        loaded, self.loaded = self.loaded, self.loaded + 1
        return torch.tensor([os.getpid(), loaded, self.inits])


def _count_init(worker_id: int) -> None:
    get_worker_info().dataset.inits += 1


def _epochs(loader, epochs: int = 3):
    return [torch.cat(list(loader)) for _ in range(epochs)]


def test_without_persistent_workers_each_loop_has_new_workers_and_a_fresh_dataset():
    with from_dataset(Counting(), batch_size=4, num_workers=1, worker_init_fn=_count_init) as loader:
        epochs = _epochs(loader)
    pids = [set(e[:, 0].tolist()) for e in epochs]
    assert len(pids[0] | pids[1] | pids[2]) == 3  # one new worker per loop
    for e in epochs:
        assert e[:, 1].tolist() == list(range(8))  # the dataset as the parent has it, each loop
        assert set(e[:, 2].tolist()) == {1}  # worker_init_fn ran once in each new worker


def test_persistent_workers_keep_their_process_and_their_dataset():
    with from_dataset(Counting(), batch_size=4, num_workers=1, worker_init_fn=_count_init,
                      persistent_workers=True) as loader:
        epochs = _epochs(loader)
    assert len({pid for e in epochs for pid in e[:, 0].tolist()}) == 1
    assert torch.cat(epochs)[:, 1].tolist() == list(range(24))


def test_new_workers_go_on_from_where_the_loader_stood():
    # A loop left unfinished, a resumed state, and a sampler: each next loop starts right.
    with from_dataset(Counting(), batch_size=2, num_workers=2) as loader:
        first = iter(loader)
        next(first)
        assert len(list(loader)) == 4  # a whole new epoch, on new workers
        loader.load_state_dict({"epoch_idx": 5, "iteration": 3})
        assert len(list(loader)) == 1
    dataset = Counting()
    with from_dataset(dataset, batch_size=4, num_workers=1, sampler=SequentialSampler(dataset),
                      worker_init_fn=_count_init) as loader:
        epochs = _epochs(loader, 2)
    assert len({pid for e in epochs for pid in e[:, 0].tolist()}) == 2
    assert all(e[:, 1].tolist() == list(range(8)) for e in epochs)


def test_new_workers_draw_new_seeds_each_loop():
    # As DataLoader's: each loop's workers are seeded anew, so random augmentations differ.
    class Noisy(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.rand(())

    torch.manual_seed(0)
    with from_dataset(Noisy(), batch_size=4, num_workers=1) as loader:
        first, second = (next(iter(loader)) for _ in range(2))
    assert not torch.equal(first, second)


def test_without_persistent_workers_the_workers_stop_when_a_loop_ends():
    with from_dataset(Counting(), batch_size=4, num_workers=2) as loader:
        batches = list(loader)
        assert loader.source.worker_pids() == []  # stopped, as a DataLoader's after its epoch
        assert batches[1][:, 1].tolist() == [1, 2, 3, 4] or len(batches) == 2  # still readable
        assert len(loader) == 2
        state = loader.state_dict()
        assert state["epoch_idx"] == 1 and state["iteration"] == 0
        assert len(list(loader)) == 2
    with from_dataset(Counting(), batch_size=4, num_workers=2, persistent_workers=True) as loader:
        list(loader)
        assert len(loader.source.worker_pids()) == 2
