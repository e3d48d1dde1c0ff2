"""extsrc.torch.from_dataset against torch.utils.data.DataLoader on the same datasets."""

from __future__ import annotations

import collections
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from extsrc.torch import from_dataset

from sample_datasets import Changing, Draws, Ragged, Records, collated_alone


def _same(ours, theirs, where=""):
    """Equal structure, types, dtypes, shapes and values."""
    assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} vs {type(theirs).__name__}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, where
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        for key in theirs:
            _same(ours[key], theirs[key], f"{where}[{key!r}]")
    else:
        assert len(ours) == len(theirs), where
        for k, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"{where}[{k}]")


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "namedtuple", "single"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_batches_as_a_dataloader_without_shuffling(kind, drop_last):
    dataset = Records(23, kind)
    theirs = list(DataLoader(dataset, batch_size=5, drop_last=drop_last))
    with from_dataset(dataset, batch_size=5, drop_last=drop_last, num_workers=2) as loader:
        assert len(loader) == len(DataLoader(dataset, batch_size=5, drop_last=drop_last))
        for epoch in range(2):
            ours = list(loader)
            assert len(ours) == len(theirs)
            for i, (a, b) in enumerate(zip(ours, theirs)):
                _same(a, b, f"epoch {epoch} batch {i}")


def _labels(batches):
    return [label for _image, labels, _half in batches for label in labels.tolist()]


def test_shuffled_epochs_hold_the_same_samples_as_a_dataloaders_in_new_orders():
    dataset = Records(50)
    torch.manual_seed(0)
    theirs = [sorted(_labels(DataLoader(dataset, batch_size=8, shuffle=True))) for _ in range(2)]
    with from_dataset(dataset, batch_size=8, shuffle=True, seed=3, num_workers=2) as loader:
        epochs = [_labels(loader) for _ in range(3)]
    assert [sorted(e) for e in epochs] == theirs + theirs[:1] == [list(range(50))] * 3
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(50))
    with from_dataset(dataset, batch_size=8, shuffle=True, seed=3, num_workers=1) as again:
        assert _labels(again) == epochs[0]  # the seed decides the order, not the workers


def test_shards_split_the_records_as_a_distributed_sampler_does():
    from torch.utils.data.distributed import DistributedSampler

    dataset = Records(21)
    ours, theirs = [], []
    for rank in range(2):
        with from_dataset(dataset, batch_size=4, shard=(rank, 2), num_workers=1) as loader:
            ours.append(_labels(loader))
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False)
        theirs.append(_labels(DataLoader(dataset, batch_size=4, sampler=sampler)))
    assert ours == theirs  # every other record, the shorter shard padded from the start


def test_a_ragged_field_gives_a_list_of_tensors_where_a_dataloader_fails():
    with pytest.raises(RuntimeError):
        list(DataLoader(Ragged(), batch_size=4))
    with from_dataset(Ragged(), batch_size=4, num_workers=2) as loader:
        batches = list(loader)
    sequences, labels = batches[0]
    assert isinstance(sequences, list) and [t.tolist() for t in sequences] == [
        [0.0], [1.0, 2.0], [2.0, 3.0, 4.0], [3.0]
    ]
    assert labels.tolist() == [0, 1, 2, 3]


class BigEndian(torch.utils.data.Dataset):
    """Fields as FITS files give them: big-endian arrays, one of them ragged. ``native``: the
    same values in native byte order, which a DataLoader takes."""

    def __init__(self, kind, native=False):
        self.kind, self.order = kind, "=" if native else ">"

    def __len__(self):
        return 12

    def __getitem__(self, i):
        image = (np.arange(6).reshape(2, 3) + i).astype(self.order + "f4")
        if self.kind == "single":
            return image
        return {"image": image, "spectrum": (np.arange(1 + i % 3) * i).astype(self.order + "f8"),
                "label": np.array(i, self.order + "i8")}


@pytest.mark.parametrize("sampled", [False, True], ids=["own-order", "sampler"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["single", "dict"])
def test_big_endian_fields_come_as_the_native_tensors_of_their_values(kind, num_workers, sampled):
    # A DataLoader refuses them (torch.from_numpy takes native byte order only); the workers
    # convert them here. The ragged field is a list of tensors, as for any ragged field.
    with pytest.raises(ValueError, match="byte order"):
        next(iter(DataLoader(BigEndian(kind), batch_size=4)))
    dataset = BigEndian(kind)
    sampler = dict(sampler=torch.utils.data.SequentialSampler(dataset)) if sampled else {}
    with from_dataset(dataset, batch_size=4, num_workers=num_workers, **sampler) as loader:
        ours = list(loader)
    native = BigEndian(kind, native=True)
    for i, batch in enumerate(ours):
        samples = [native[4 * i + k] for k in range(4)]
        if kind == "single":
            _same(batch, torch.from_numpy(np.stack(samples)), f"batch {i}")
            continue
        _same(batch["image"], torch.from_numpy(np.stack([s["image"] for s in samples])), f"batch {i}")
        _same(batch["label"], torch.from_numpy(np.stack([s["label"] for s in samples])), f"batch {i}")
        _same(batch["spectrum"], [torch.from_numpy(s["spectrum"]) for s in samples], f"batch {i}")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_draw_different_random_numbers(start_method):
    with from_dataset(Draws(), batch_size=8, num_workers=2, multiprocessing_context=start_method) as loader:
        rows = torch.cat(list(loader)).tolist()
    by_worker = collections.defaultdict(list)
    for *draws, pid in rows:
        by_worker[pid].append(draws)
    assert len(by_worker) == 2, "both workers loaded samples"
    first, second = by_worker.values()
    for generator in range(3):  # numpy, random, torch: no two workers repeat each other's draws
        assert not set(d[generator] for d in first) & set(d[generator] for d in second)


def test_a_sample_of_another_layout_is_an_error_naming_it():
    with from_dataset(Changing(), batch_size=2, num_workers=1) as loader:
        with pytest.raises(TypeError, match=r"dataset\[5\] is \(tensor, tensor, tensor\), and the "
                                            r"first sample this worker loaded \(tensor, tensor\)"):
            list(loader)


class _SparseSamples(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.eye(2).to_sparse()


def test_a_sparse_tensor_sample_is_an_error_saying_to_make_it_dense():
    with from_dataset(_SparseSamples(), batch_size=2, num_workers=1) as loader:
        with pytest.raises(TypeError, match=r"dataset\[0\]: a torch.sparse_coo tensor; .*tensor.to_dense\(\)"):
            list(loader)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize("dataset, kwargs, error, match", [
    (Records(4), dict(collate_fn=3), TypeError, "collate_fn must be a callable"),
    (Records(4), dict(sampler=[0, 1], shuffle=True), ValueError, "mutually exclusive with shuffle"),
    (Records(4), dict(batch_sampler=[[0, 1]]), ValueError, "batch_sampler option is mutually"),
    (Records(4), dict(sampler=[0, 1], seed=3), ValueError, "the sampler decides"),
    (_Stream(), dict(sampler=[0, 1]), ValueError, "IterableDataset: expected unspecified sampler"),
    (Records(4), dict(generator=3), TypeError, "generator must be a torch.Generator"),
    (Records(4), dict(in_order=0), TypeError, "in_order must be True or False"),
    (Records(4), dict(colate_fn=None), TypeError, "unexpected keyword argument 'colate_fn'"),
    (Records(4), dict(num_workers=0, persistent_workers=True), ValueError, "num_workers > 0"),
    (Records(4), dict(batch_size=None, drop_last=True), ValueError, "batch_size=None"),
    (Records(4), dict(multiprocessing_context="threads"), ValueError, "multiprocessing_context"),
    (Records(4), dict(worker_init_fn=3), TypeError, "worker_init_fn must be a callable"),
    (_Stream(), dict(shuffle=True), ValueError, "IterableDataset: expected unspecified shuffle"),
    (object(), {}, TypeError, "map-style dataset"),
])
def test_what_does_not_map_is_refused_saying_what_to_do(dataset, kwargs, error, match):
    with pytest.raises(error, match=match):
        from_dataset(dataset, **{"batch_size": 2, **kwargs})


def test_dataloader_arguments_that_map_are_taken():
    with from_dataset(Records(12), batch_size=4, num_workers=2, prefetch_factor=3, timeout=30,
                      persistent_workers=False, in_order=True, pin_memory=False,
                      multiprocessing_context="fork") as loader:
        assert loader.source.prefetch == 6 and loader.source.timeout == 30
        assert _labels(loader) == list(range(12))


def test_without_prefetch_factor_small_batches_go_further_ahead_and_with_one_they_do_not():
    # The engine's default prefetch (as many batches per worker as DataLoader's 2) widens for
    # batches of at most 1 MiB once their tasks are timed as short; prefetch_factor=2, given,
    # stays 2 per worker.
    import time

    class Small(torch.utils.data.Dataset):
        def __len__(self):
            return 1 << 30

        def __getitem__(self, i):
            return np.full(64, i % 251, np.uint8)

    with from_dataset(Small(), batch_size=8, num_workers=2) as loader:
        batches = iter(loader)
        deadline = time.monotonic() + 60
        while loader.source.prefetch <= 4 and time.monotonic() < deadline:
            next(batches)
        assert loader.source.prefetch > 4 and loader.prefetch_factor == 2
    with from_dataset(Small(), batch_size=8, num_workers=2, prefetch_factor=2) as loader:
        for _, _ in zip(range(300), loader):
            pass
        assert loader.source.prefetch == 4


class _KeysInAnyOrder(torch.utils.data.Dataset):
    """Dict samples whose keys come in an order that depends on the record."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"label": i, "image": torch.full((2,), i)} if i % 2 else {"image": torch.full((2,), i), "label": i}


@pytest.mark.parametrize("shuffle", [False, True])
def test_dict_samples_are_collated_by_key_whatever_the_order_of_their_keys(shuffle):
    dataset = _KeysInAnyOrder()
    theirs = list(DataLoader(dataset, batch_size=4))
    with from_dataset(dataset, batch_size=4, shuffle=shuffle, num_workers=2) as loader:
        ours = list(loader)
    if not shuffle:
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"batch {i}")
    for batch in ours:
        assert list(batch) == ["image", "label"]  # dataset[0]'s order, as default_collate keeps it
        assert (batch["image"][:, 0] == batch["label"]).all()
    assert sorted(r for b in ours for r in b["label"].tolist()) == list(range(8))


class _OtherKeys(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"image": np.zeros(2), "label": i} if i != 3 else {"image": np.zeros(2), "target": i}


def test_a_dict_sample_with_other_keys_is_an_error_naming_them():
    with from_dataset(_OtherKeys(), batch_size=2, num_workers=1) as loader:
        with pytest.raises(TypeError, match=r"dataset\[3\] is \{'image': tensor, 'target': tensor\}, "
                                            r"and the first sample this worker loaded "
                                            r"\{'image': tensor, 'label': tensor\}.*give "
                                            r"collate_fn=lambda samples: default_collate\(samples\)"):
            list(loader)


class _JoinedKeys(torch.utils.data.Dataset):
    """Two datasets of other keys joined, each batch of one of them."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"image": np.zeros(2), "label": i} if i < 4 else {"image": np.zeros(2), "target": i}


def test_the_collate_fn_the_error_names_loads_batches_whose_keys_change():
    kwargs = dict(batch_size=4, num_workers=2, collate_fn=collated_alone)
    with from_dataset(_JoinedKeys(), **kwargs) as loader:
        ours = [(sorted(batch), batch.get("label", batch.get("target")).tolist()) for batch in loader]
    theirs = [(sorted(batch), batch.get("label", batch.get("target")).tolist())
              for batch in DataLoader(_JoinedKeys(), **kwargs)]
    assert ours == theirs == [(["image", "label"], [0, 1, 2, 3]), (["image", "target"], [4, 5, 6, 7])]


def test_a_dataset_smaller_than_a_batch_with_drop_last_is_refused_in_from_datasets_terms():
    assert len(DataLoader(Records(3), batch_size=5, drop_last=True)) == 0  # a DataLoader yields nothing
    with pytest.raises(ValueError, match=r"3 records .* no batch of batch_size=5 with drop_last=True; "
                                         r"give drop_last=False or a batch_size of at most 3"):
        from_dataset(Records(3), batch_size=5, drop_last=True, num_workers=1)
    with from_dataset(Records(3), batch_size=5, num_workers=1) as loader:  # without drop_last: one short batch
        assert [labels.tolist() for _image, labels, _half in loader] == [[0, 1, 2]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_whose_length_changed_is_refused_not_loaded_in_part(num_workers):
    dataset = Records(10)
    with from_dataset(dataset, batch_size=4, num_workers=num_workers) as loader:
        assert [labels.tolist() for _image, labels, _half in loader][-1] == [8, 9]
        dataset.n = 14  # records added: the loader's order covers the first 10
        with pytest.raises(ValueError, match=r"len\(dataset\) is 14, and was 10 .* leave out the 4 "
                                             r"records added since.*sampler=SequentialSampler"):
            iter(loader)
        dataset.n = 6
        with pytest.raises(ValueError, match=r"ask for 4 records the dataset no longer has"):
            iter(loader)
        dataset.n = 10  # the length the order was made for: loops go on
        assert [labels.tolist() for _image, labels, _half in loader][-1] == [8, 9]
    # The way out the error names: a sampler, drawn again at each loop (new workers each loop).
    dataset = Records(10)
    sampler = torch.utils.data.SequentialSampler(dataset)
    with from_dataset(dataset, batch_size=4, num_workers=num_workers, sampler=sampler) as loader:
        assert [labels.tolist() for _image, labels, _half in loader][-1] == [8, 9]
        dataset.n = 14
        assert [labels.tolist() for _image, labels, _half in loader][-1] == [12, 13]


class _Counting(torch.utils.data.Dataset):
    """Counts the calls of __getitem__ made in this process (a worker's are its own)."""

    calls = 0

    def __len__(self):
        return 4

    def __getitem__(self, i):
        type(self).calls += 1
        return np.full((2,), i)


def test_no_sample_is_read_in_this_process():
    _Counting.calls = 0
    with from_dataset(_Counting(), batch_size=2, num_workers=1) as loader:
        assert [b[:, 0].tolist() for b in loader] == [[0, 1], [2, 3]]
    assert _Counting.calls == 0  # as in a DataLoader: only the workers call __getitem__


class _FailsAt5(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == 5:
            raise KeyError("missing file")
        return i


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
@pytest.mark.parametrize("shuffle", [False, True])
def test_an_error_in_getitem_names_the_index_it_was_called_with(shuffle):
    with from_dataset(_FailsAt5(), batch_size=4, shuffle=shuffle, num_workers=2) as loader:
        with pytest.raises(KeyError, match="missing file") as caught:
            list(loader)
    assert any("dataset[5]" in note for note in caught.value.__notes__), caught.value.__notes__


class HoldsALock(torch.utils.data.Dataset):
    def __init__(self):
        import threading

        self.lock = threading.Lock()

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return np.zeros(2)


def test_a_dataset_spawned_workers_cannot_receive_is_refused_with_the_loader_s_own_fix():
    from extsrc.errors import SourcePicklingError

    with pytest.raises(SourcePicklingError, match="lock") as raised:
        with from_dataset(HoldsALock(), batch_size=2, num_workers=1,
                          multiprocessing_context="spawn") as loader:
            next(iter(loader))
    assert "multiprocessing_context='fork'" in str(raised.value)


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:0", "mps", "meta", "cuda:x", 3])
def test_device_is_honoured_or_refused_the_same_with_and_without_workers(device):
    # num_workers=0 took any device= and gave CPU tensors, silently; with workers the same
    # device= gave CUDA tensors or an error saying why not.
    outcomes = []
    for workers in (0, 2):
        try:
            with from_dataset(Records(8), batch_size=4, num_workers=workers, device=device) as loader:
                outcomes.append(("tensors on", str(next(iter(loader))[0].device)))
        except (ValueError, RuntimeError) as error:
            outcomes.append((type(error).__name__, str(error)))
    assert outcomes[0] == outcomes[1]
    if device in (None, "cpu"):
        assert outcomes[0] == ("tensors on", "cpu")
    elif not torch.cuda.is_available() or device in ("mps", "meta", "cuda:x"):
        assert outcomes[0][0] in ("ValueError", "RuntimeError"), outcomes[0]


class MixedNumbers(torch.utils.data.Dataset):
    """Fields whose type changes from sample to sample, as default_collate promotes them."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        dtype = torch.int32 if i % 2 else torch.float32
        return {"weight": 1 if i % 2 == 0 else 2.5, "x": torch.full((2,), i, dtype=dtype)}


def test_without_workers_the_batches_are_dataloaders_own_collation():
    ours = next(iter(from_dataset(MixedNumbers(), batch_size=4)))
    theirs = next(iter(torch.utils.data.DataLoader(MixedNumbers(), batch_size=4)))
    assert isinstance(ours["weight"], torch.Tensor) and isinstance(ours["x"], torch.Tensor)
    assert ours["weight"].dtype == theirs["weight"].dtype and ours["x"].dtype == theirs["x"].dtype
    assert torch.equal(ours["weight"], theirs["weight"]) and torch.equal(ours["x"], theirs["x"])
