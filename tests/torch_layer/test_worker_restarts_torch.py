"""from_dataset(worker_restarts=N): a lost worker is replaced and the loop gives DataLoader's
batches unchanged; without it (the default, as DataLoader) the loop ends with the error."""

import pytest
import torch

from extsrc.errors import WorkerDiedError
from extsrc.torch import from_dataset

from sample_datasets import KillsOnce


def _batches(loader):
    return [(batch["image"].clone(), batch["label"].clone()) for batch in loader]


@pytest.mark.parametrize("collate_fn", [None, torch.utils.data.default_collate])
def test_a_killed_worker_is_replaced_and_the_batches_are_dataloaders(tmp_path, collate_fn):
    mark = tmp_path / "kill"
    mark.touch()
    dataset = KillsOnce(64, 37, str(mark))
    with from_dataset(dataset, batch_size=8, num_workers=2, worker_restarts=1,
                      collate_fn=collate_fn) as loader:
        ours = _batches(loader)
    assert not mark.exists()  # a worker did die
    theirs = _batches(torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=collate_fn))
    assert len(ours) == len(theirs) == 8
    for (image, label), (image_t, label_t) in zip(ours, theirs):
        assert torch.equal(image, image_t) and torch.equal(label, label_t)


def test_without_restarts_a_lost_worker_ends_the_loop(tmp_path):
    mark = tmp_path / "kill"
    mark.touch()
    with from_dataset(KillsOnce(64, 37, str(mark)), batch_size=8, num_workers=2) as loader:
        with pytest.raises(WorkerDiedError):
            _batches(loader)
