"""A dataset's ``__getitems__(indices)``: from_dataset fetches a batch with it, as DataLoader does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset

from extsrc.torch import from_dataset

from sample_datasets import FetchedInBatches, NoBatchFetch, Ragged, Records


def _flat(batch):
    """A batch as comparable values that keep its types, dtypes and key order."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", batch.dtype, batch.tolist())
    if isinstance(batch, dict):
        return ("dict", [(key, _flat(value)) for key, value in batch.items()])
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, [_flat(part) for part in batch])
    return (type(batch).__name__, batch)


@pytest.mark.parametrize("kwargs", [
    dict(batch_size=4, num_workers=0),
    dict(batch_size=4, num_workers=2),
    dict(batch_size=4, num_workers=2, drop_last=True, multiprocessing_context="spawn"),
    dict(batch_size=3, num_workers=2, shuffle=True, generator=5),  # a generator seeded 5 each
    dict(batch_size=4, num_workers=2, collate_fn=lambda samples: [s["label"] * 10 for s in samples]),
    dict(batch_sampler=[[3, 1], [0, 2, 4, 10], [9]], num_workers=2),
])
def test_a_dataset_read_a_batch_at_a_time_gives_a_dataloaders_batches(kwargs):
    def given():
        seed = kwargs.get("generator")
        return kwargs if seed is None else dict(kwargs, generator=torch.Generator().manual_seed(seed))

    theirs = [_flat(batch) for batch in DataLoader(FetchedInBatches(), **given())]
    with from_dataset(FetchedInBatches(), **given()) as loader:
        ours = [_flat(batch) for batch in loader]
    assert ours == theirs
    assert len(ours) >= 2


def test_batch_size_none_fetches_each_index_by_getitem_as_a_dataloader():
    with from_dataset(Records(5), batch_size=None, num_workers=2) as loader:
        images = [sample[0] for sample in loader]
    assert [int(image[0, 0]) for image in images] == [0, 1, 2, 3, 4]
    with pytest.raises(NotImplementedError):  # DataLoader too calls dataset[i] without batches
        next(iter(from_dataset(FetchedInBatches(), batch_size=None)))


def test_getitems_set_to_none_fetches_each_index_as_a_dataloader():
    kwargs = dict(batch_size=3, num_workers=2)
    theirs = [_flat(batch) for batch in DataLoader(NoBatchFetch(7), **kwargs)]
    with from_dataset(NoBatchFetch(7), **kwargs) as loader:
        assert [_flat(batch) for batch in loader] == theirs


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_in_getitems_names_the_call_and_the_loop_goes_on(num_workers):
    dataset = FetchedInBatches()
    dataset.fails_at_7 = True
    with from_dataset(dataset, batch_size=4, num_workers=num_workers) as loader:
        batches = iter(loader)
        assert next(batches)["label"].tolist() == [0, 1, 2, 3]
        with pytest.raises(KeyError) as raised:
            next(batches)
        assert next(batches)["label"].tolist() == [8, 9, 10]
    assert "raised by dataset.__getitems__([4, 5, 6, 7])" in "\n".join(raised.value.__notes__)


def test_a_collated_batch_from_getitems_needs_a_collate_fn_and_says_so():
    dataset = FetchedInBatches()
    dataset.collated = True
    with from_dataset(dataset, batch_size=4, num_workers=2) as loader:
        with pytest.raises(TypeError, match=r"__getitems__\(\[0, 1, 2, 3\]\) returned a dict.*give a collate_fn"):
            next(iter(loader))
    with from_dataset(dataset, batch_size=4, num_workers=2, collate_fn=lambda batch: batch["label"]) as loader:
        assert [batch.tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]


def test_skipping_bad_samples_is_refused_for_a_dataset_read_a_batch_at_a_time():
    with pytest.raises(ValueError, match=r"on_error='skip' needs .*dataset.__getitems__"):
        from_dataset(FetchedInBatches(), batch_size=4, num_workers=2, on_error="skip")


def test_a_subset_of_a_dataset_without_getitems_still_loads_sample_by_sample():
    # Subset has a __getitems__ that calls dataset[i] for each index: the samples are the same,
    # and per-sample features (skipping a bad sample) stay available.
    subset = Subset(Records(12), [5, 0, 7, 3, 9, 1])
    with from_dataset(subset, batch_size=4, num_workers=2, on_error="skip") as loader:
        labels = [batch[1].tolist() for batch in loader]
    assert labels == [[5, 0, 7, 3], [9, 1]]


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "namedtuple", "single", "nested"])
def test_a_sampler_s_batches_have_a_dataloaders_types_and_dtypes(kind):
    kwargs = dict(batch_size=3, sampler=[4, 0, 9, 2, 7])
    theirs = [_flat(batch) for batch in DataLoader(Records(10, kind), **kwargs)]
    with from_dataset(Records(10, kind), num_workers=2, **kwargs) as loader:
        assert [_flat(batch) for batch in loader] == theirs


def test_a_sampler_s_ragged_field_is_a_list_of_tensors_as_without_a_sampler():
    # With a sampler the workers collate each batch too; a field whose samples differ in shape
    # comes as the default collation gives it (a list of tensors) where default_collate fails.
    with pytest.raises(RuntimeError):
        list(DataLoader(Ragged(), batch_size=4, sampler=[0, 1, 2, 3]))
    with from_dataset(Ragged(), batch_size=4, sampler=[0, 1, 2, 3], num_workers=2) as loader:
        (sequences, labels), = list(loader)
    assert isinstance(sequences, list) and [t.tolist() for t in sequences] == [
        [0.0], [1.0, 2.0], [2.0, 3.0, 4.0], [3.0]]
    assert labels.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("num_workers", [1, 2])
def test_batches_alike_in_shape_after_a_ragged_one_come_as_dataloader_s(num_workers):
    # Lengths 1 and 1, then 1 and 2, then 3 and 3: those alike stack as DataLoader's do,
    # whichever batch of their worker came ragged before them.
    batch_sampler = [[0, 3], [3, 4], [2, 5], [0, 3], [5, 8]]
    alike = [0, 2, 3, 4]
    theirs = list(DataLoader(Ragged(), batch_sampler=[batch_sampler[k] for k in alike]))
    with from_dataset(Ragged(), batch_sampler=batch_sampler, num_workers=num_workers) as loader:
        ours = list(loader)
    sequences, labels = ours[1]
    assert isinstance(sequences, list) and [t.tolist() for t in sequences] == [[3.0], [4.0, 5.0]]
    assert labels.tolist() == [3, 4]
    assert [_flat(ours[k]) for k in alike] == [_flat(batch) for batch in theirs]


class _Bucketed(torch.utils.data.Dataset):
    """A list field as long as its bucket: batches of one structure each, not all alike."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"ids": list(range(i // 2 + 1)), "label": i}


class _MixedDtypes(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i < 2:
            return np.ones(2, np.float32 if i % 2 else np.float64), i if i % 2 else float(i)
        return torch.full((2,), i, dtype=torch.bfloat16), i


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_batch_sampler_s_batches_may_each_have_a_structure_of_their_own(num_workers):
    kwargs = dict(batch_sampler=[[0, 1], [2, 3], [4, 5], [6, 7]])
    theirs = [_flat(batch) for batch in DataLoader(_Bucketed(), **kwargs)]
    with from_dataset(_Bucketed(), num_workers=num_workers, **kwargs) as loader:
        assert [_flat(batch) for batch in loader] == theirs


def test_a_sampler_s_batches_of_mixed_or_bfloat16_dtypes_are_collated_as_a_dataloaders():
    # Collated as default_collate does in a DataLoader's worker: in the first sample's dtype.
    kwargs = dict(batch_size=2, sampler=[0, 1, 2, 3])
    theirs = [_flat(batch) for batch in DataLoader(_MixedDtypes(), num_workers=2, **kwargs)]
    with from_dataset(_MixedDtypes(), num_workers=2, **kwargs) as loader:
        ours = [_flat(batch) for batch in loader]
    assert ours == theirs
    assert ours[1][1][0][1] == torch.bfloat16
