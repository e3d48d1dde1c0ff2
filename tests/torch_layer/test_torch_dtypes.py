"""Tensors of dtypes NumPy has none for (bfloat16, the float8 kinds, complex32): from_dataset
carries their bits and gives back the DataLoader's tensors, of the same dtype, bit for bit."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from extsrc.engine import Flattener
from extsrc.torch import from_dataset
from extsrc.torch.structure import TENSOR_LEAVES

DTYPES = [torch.bfloat16, torch.complex32] + [
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, name)]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "ComplexHalf support is experimental")
        yield


def _values(dtype, i, length=4):
    return (torch.arange(length) + i).to(dtype)


class Fields(Dataset):
    """A dict of a tensor of ``dtype``, a tuple of it and a float tensor, and a label."""

    def __init__(self, dtype, count=8):
        self.dtype, self.count = dtype, count

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        return {"x": _values(self.dtype, i), "pair": (_values(self.dtype, -i, 2), torch.full((2,), float(i))),
                "label": i}


class Stream(IterableDataset):
    def __init__(self, dtype):
        self.dtype = dtype

    def __iter__(self):
        return iter(Fields(self.dtype)[i] for i in range(8))


def _flat(batch):
    """A batch as comparable values: types, dtypes, shapes and each tensor's bits."""
    if isinstance(batch, torch.Tensor):
        bits = batch.view(_BITS[batch.element_size()]) if batch.element_size() in _BITS and \
            batch.dtype not in (torch.int16, torch.int32, torch.uint8) else batch
        return ("tensor", batch.dtype, tuple(batch.shape), bits.tolist())
    if isinstance(batch, dict):
        return ("dict", [(key, _flat(value)) for key, value in batch.items()])
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, [_flat(part) for part in batch])
    return (type(batch).__name__, batch)


def _wrapped_collate(samples):
    return default_collate(samples)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(batch_size=3, num_workers=2), id="own-order"),
    pytest.param(dict(batch_size=3, num_workers=0), id="in-process"),
    pytest.param(dict(batch_size=3, num_workers=2, sampler=[7, 0, 3, 5, 1]), id="sampler"),
    pytest.param(dict(batch_size=3, num_workers=2, collate_fn=_wrapped_collate), id="collate_fn"),
])
def test_a_dataset_of_a_dtype_numpy_lacks_gives_a_dataloaders_batches(dtype, kwargs):
    theirs = [_flat(batch) for batch in DataLoader(Fields(dtype), **kwargs)]
    with from_dataset(Fields(dtype), **kwargs) as loader:
        ours = [_flat(batch) for batch in loader]
    assert ours == theirs
    assert ours[0][1][0][1][1] == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, DTYPES[-1]], ids=str)
def test_an_iterable_dataset_of_such_a_dtype_gives_a_dataloaders_batches(dtype):
    theirs = [_flat(batch) for batch in DataLoader(Stream(dtype), batch_size=3, num_workers=1)]
    with from_dataset(Stream(dtype), batch_size=3, num_workers=1) as loader:
        ours = [_flat(batch) for batch in loader]
    assert ours == theirs


class RaggedHalves(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return _values(torch.bfloat16, i, length=i + 1), i


def test_a_ragged_field_of_such_a_dtype_comes_as_a_list_of_its_tensors():
    with from_dataset(RaggedHalves(), batch_size=3, num_workers=2) as loader:
        batches = list(loader)
    tensors = [tensor for values, _ in batches for tensor in values]
    assert [t.dtype for t in tensors] == [torch.bfloat16] * 6
    assert [t.tolist() for t in tensors] == [_values(torch.bfloat16, i, i + 1).tolist() for i in range(6)]


@pytest.mark.parametrize("first, later", [
    pytest.param(torch.bfloat16, torch.float16, id="bfloat16-then-float16"),
    pytest.param(torch.bfloat16, torch.int16, id="bfloat16-then-int16"),
    pytest.param(torch.float32, torch.bfloat16, id="float32-then-bfloat16"),
    pytest.param(DTYPES[2], DTYPES[3], id="two-float8-kinds"),
])
def test_a_field_that_changes_to_or_from_such_a_dtype_is_refused_not_misread(first, later):
    # Both travel as integers of one size; the learnt dtype must not be read into the other's bits.
    flatten = Flattener(TENSOR_LEAVES)
    flatten({"x": _values(first, 0), "label": 0}, "dataset[0]")
    named = str(later).rpartition(".")[2] if later in DTYPES else "tensor"
    with pytest.raises(TypeError, match=re.escape(f"dataset[5] is {{'label': tensor, 'x': {named}")):
        flatten({"x": _values(later, 5), "label": 5}, "dataset[5]")


def test_a_quantized_tensor_is_refused_naming_its_field():
    flatten = Flattener(TENSOR_LEAVES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match=re.escape("dataset[3]['x']: a torch.qint8 tensor")):
        flatten({"x": quantized}, "dataset[3]")


def test_the_bits_of_such_a_tensor_are_not_copied_in_the_worker():
    tensor = _values(torch.bfloat16, 3, 1024)
    _, array = Flattener(TENSOR_LEAVES)(tensor, "dataset[3]")
    assert array.dtype == np.int16 and array.ctypes.data == tensor.data_ptr()
