"""default_collate called in from_dataset's workers (by a collate_fn, or for a batch not written
as columns) stacks in the worker's memory, not in a torch shared-memory file per tensor, and
otherwise collates and fails as in a DataLoader's worker."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate
from torch.utils.data._utils import collate

from extsrc.torch import from_dataset


class Pairs(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": torch.full((3, 4), float(i)), "y": i}


class Stream(IterableDataset):
    def __iter__(self):
        return iter(Pairs()[i] for i in range(8))


def _made_in_shared_memory(samples):
    """A collate_fn wrapping default_collate that says where default_collate put its tensors."""
    batch = default_collate(samples)
    return batch, torch.tensor(batch["x"].is_shared())


@pytest.mark.parametrize("dataset", [Pairs, Stream])
def test_a_collate_fn_calling_default_collate_gets_tensors_in_the_workers_memory(dataset):
    kwargs = dict(batch_size=3, num_workers=2 if dataset is Pairs else 1, collate_fn=_made_in_shared_memory)
    theirs = list(DataLoader(dataset(), **kwargs))
    with from_dataset(dataset(), **kwargs) as loader:
        ours = list(loader)
    assert [bool(shared) for _, shared in theirs] == [True] * 3  # a DataLoader worker's
    assert [bool(shared) for _, shared in ours] == [False] * 3
    assert [batch["x"].tolist() for batch, _ in ours] == [batch["x"].tolist() for batch, _ in theirs]
    assert [batch["y"].tolist() for batch, _ in ours] == [batch["y"].tolist() for batch, _ in theirs]


class Uneven(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(i + 1)


def _wrapped(samples):
    return default_collate(samples)


def test_tensors_of_different_sizes_fail_as_in_a_dataloader():
    kwargs = dict(batch_size=2, num_workers=1, collate_fn=_wrapped)
    assert _outcome(DataLoader(Uneven(), **kwargs))[0] == "RuntimeError"
    with from_dataset(Uneven(), batch_size=2, num_workers=1, collate_fn=_wrapped) as loader:
        with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
            list(loader)


class Nested(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])


def test_nested_tensors_get_pytorchs_own_error():
    with from_dataset(Nested(), batch_size=2, num_workers=1, collate_fn=_wrapped) as loader:
        with pytest.raises(RuntimeError, match="Batches of nested tensors are not currently supported"):
            list(loader)


def _tagged(batch, *, collate_fn_map=None):
    return torch.stack(batch, 0) + 1000


def test_a_tensor_collation_a_user_registered_stays_in_the_workers():
    saved = collate.default_collate_fn_map[torch.Tensor]
    collate.default_collate_fn_map[torch.Tensor] = _tagged  # before the (forked) workers start
    try:
        with from_dataset(Pairs(), batch_size=4, num_workers=2, collate_fn=_wrapped,
                          multiprocessing_context="fork") as loader:
            first = next(iter(loader))
    finally:
        collate.default_collate_fn_map[torch.Tensor] = saved
    assert first["x"][1, 0, 0].item() == 1001.0


class TwoDtypes(Dataset):
    """Samples whose tensors differ in dtype: the batch is stacked in the first one's, or fails."""

    def __init__(self, first, second, requires_grad=False):
        self.dtypes, self.requires_grad = (first, second), requires_grad

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.tensor([257, i], dtype=self.dtypes[i]).requires_grad_(self.requires_grad)


def _outcome(loader):
    """The batches of a loop over ``loader``, or its error (type and last line); a DataLoader's
    workers stopped before this returns (an iterator its error's traceback holds would keep them)."""
    batches = iter(loader)
    try:
        return [(batch.dtype, batch.tolist()) for batch in batches]
    except Exception as exc:  # noqa: BLE001 - the error itself is compared
        name, last = type(exc).__name__, str(exc).splitlines()[-1]
        return name, last.removeprefix(f"{name}: ")  # a DataLoader repeats the type in the worker's line
    finally:
        del batches
        gc.collect()


@pytest.mark.parametrize("dataset", [
    pytest.param(TwoDtypes(torch.int16, torch.int64), id="int16-then-int64"),
    pytest.param(TwoDtypes(torch.float32, torch.float64), id="float32-then-float64"),
    pytest.param(TwoDtypes(torch.int16, torch.bfloat16), id="int16-then-bfloat16"),
    pytest.param(TwoDtypes(torch.float32, torch.float32, requires_grad=True), id="requiring-grad"),
])
def test_a_batch_of_mixed_dtypes_is_stacked_or_refused_as_in_a_dataloaders_worker(dataset):
    kwargs = dict(batch_size=2, num_workers=1, collate_fn=_wrapped)
    theirs = _outcome(DataLoader(dataset, **kwargs))
    with from_dataset(dataset, **kwargs) as loader:
        assert _outcome(loader) == theirs
