"""A batch rebuilt from its samples' structures as ``default_collate`` gives it, in tensors.

The workers flatten each sample with the engine's :class:`~extsrc.engine.Flattener` (tensors
as leaves, :data:`TENSOR_LEAVES`); :class:`Collation` checks that a batch's samples share one
structure and puts the leaves' tensors back as ``default_collate`` shapes them (a list of
tensors where samples differ in shape). A ``collate_fn``'s whole batch
(:func:`~extsrc.engine.pack_whole`) comes back as it was made, its tensors views of the shared
memory (:func:`unpack_whole`).
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from extsrc.engine import (ARRAY, BYTES, MAPPING, NDARRAY, PICKLED, SCALAR, STRING, Bits, ForeignLeaves, PackedLayout,
                           Structure, bits_of, bytes_str, check_same, container, leaf_error)


def _tensor_array(tensor: torch.Tensor, where: str) -> np.ndarray:
    """A CPU tensor as the NumPy array over its memory; ``TypeError`` naming ``where`` else."""
    try:
        # A CPU tensor of a NumPy dtype without grad, conjugate or negative bit (nearly every
        # sample): its memory as is, in 0.8 us instead of 1.7 for the calls below.
        return tensor.numpy()
    except (RuntimeError, TypeError):
        pass  # which of those it is, and what to do, below
    if tensor.device.type != "cpu":
        raise leaf_error(where, f"a tensor on {tensor.device}; samples must be CPU tensors (the "
                                "workers are processes without CUDA)")
    if tensor.layout != torch.strided:
        raise leaf_error(where, f"a {tensor.layout} tensor; samples must be dense tensors (return "
                                "tensor.to_dense())")
    try:
        return tensor.detach().resolve_conj().resolve_neg().numpy()
    except TypeError as exc:
        raise leaf_error(where, f"a {tensor.dtype} tensor, which NumPy cannot hold ({exc}); "
                                "return another dtype (e.g. tensor.float())") from None


_TORCH_DTYPES = {np.dtype(d): torch.from_numpy(np.empty(0, d)).dtype for d in (
    np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128)}  # NumPy's dtype -> the tensor's


def _bits_views() -> Dict[torch.dtype, Tuple[str, torch.dtype]]:
    """PyTorch's dtypes NumPy has none for, of this PyTorch: each one's name and the integer
    dtype of its size that its bits travel in (quantized ones have none: their scale would be lost)."""
    sized = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    views = {}
    for name in ("bfloat16", "complex32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                 "float8_e8m0fnu", "float4_e2m1fn_x2"):
        dtype = getattr(torch, name, None)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # complex32's "experimental"
                empty = torch.empty(1, dtype=dtype)
                views[empty.dtype] = (name, empty.view(sized[empty.element_size()]).dtype)
        except (TypeError, RuntimeError, KeyError):
            continue  # not in this PyTorch, or not a dtype its bits can be viewed in
    return views


_BITS_VIEWS = _bits_views()


def _tensor_bits(tensor: torch.Tensor) -> Optional[Bits]:
    """A dense CPU tensor of a dtype NumPy has none for (bfloat16, the float8 kinds, complex32)
    as that dtype's name and a NumPy array over its bits, without a copy; None for any other."""
    found = _BITS_VIEWS.get(getattr(tensor, "dtype", None))  # type: ignore[arg-type]
    if found is None or not issubclass(type(tensor), torch.Tensor):  # not a proxy claiming to be one
        return None
    name, view = found
    try:
        return name, tensor.view(view).numpy()  # nearly every such sample (3.3 us)
    except (RuntimeError, TypeError):
        pass  # a tensor on another device, sparse, needing grad, conjugate or negative
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return None  # to_array says what to do
    return name, tensor.detach().resolve_conj().resolve_neg().view(view).numpy()


# Tensors as a structure's leaves; those of a dtype NumPy has none for, as their bits.
TENSOR_LEAVES = ForeignLeaves((torch.Tensor,), _tensor_array, _tensor_bits, native=True)


def _as_dtype(value: Any, name: Optional[str]) -> Any:
    """A leaf's tensor (or the list of a ragged output's) viewed as the dtype whose bits it holds."""
    if name is None:
        return value
    dtype = getattr(torch, name)
    return value.view(dtype) if isinstance(value, torch.Tensor) else [t.view(dtype) for t in value]


class Collation:
    """A batch of flattened samples (their tensors) as default_collate gives it; ``TypeError``
    where the samples differ in structure (a dict's keys may differ in order: the first's holds)."""

    def __init__(self) -> None:
        self._decoded: Dict[bytes, Structure] = {}

    def _decode(self, key: bytes) -> Structure:
        structure = self._decoded.get(key)
        if structure is None:
            structure = self._decoded[key] = pickle.loads(key)
        return structure

    def __call__(self, tensors: Tuple[Any, ...]) -> Any:
        encoded = tensors[0]
        if isinstance(encoded, torch.Tensor):
            rows = encoded.numpy()
            structure = self._decode(rows[0].tobytes())
            if len(rows) > 1 and not (rows == rows[0]).all():
                check_same([self._decode(row.tobytes()) for row in rows])
        else:  # structures of different lengths
            structures = [self._decode(bytes(row.numpy())) for row in encoded]
            check_same(structures)
            structure = structures[0]
        return _rebuild(structure, tensors, iter(range(1, len(tensors))))

    def of_columns(self, columns: Tuple[List[np.ndarray], ...]) -> Any:
        """A batch collated in this process from :meth:`Flattener.columns` (``num_workers=0``),
        as the workers' batches are: a list of tensors for an output whose samples differ."""
        outputs: List[Any] = []
        for column in columns:
            first = column[0]
            if all(a.shape == first.shape and a.dtype == first.dtype for a in column):
                outputs.append(torch.from_numpy(np.stack(column)))
            else:
                outputs.append([torch.from_numpy(np.array(a)) for a in column])
        return self(tuple(outputs))


def _rebuild(structure: Structure, tensors: Tuple[Any, ...], position: Any,
             transposed: bool = False) -> Any:
    kind = structure[0]
    if kind == ARRAY:
        return _as_dtype(tensors[next(position)], bits_of(structure))
    if kind in (STRING, BYTES):
        values = tensors[next(position)]
        rows = [bytes(row.numpy()) for row in values]
        strings = [bytes_str(row) for row in rows] if kind == STRING else rows
        # default_collate passes strings on as it got them: a tuple from transposing a
        # sequence's fields, a list for a dict's field or the batch itself.
        return tuple(strings) if transposed else strings
    in_sequence = kind != MAPPING
    children = [_rebuild(child, tensors, position, in_sequence) for child in structure[2]]
    return container(structure, children, list)


def _rebuild_whole(structure: Structure, leaves: "_Leaves", position: Any) -> Any:
    """A batch a collate_fn made, as it made it: tensors and NumPy arrays (views of the shared
    memory), strings, numbers and other objects in the same containers."""
    kind = structure[0]
    if kind == ARRAY:
        return _as_dtype(leaves.tensor(next(position)), bits_of(structure))
    if kind == NDARRAY:
        array = leaves.array(next(position))
        return array[()] if structure[1] else array  # a NumPy scalar, or the array
    if kind in (STRING, BYTES, PICKLED):
        data = leaves.array(next(position)).tobytes()
        return bytes_str(data) if kind == STRING else pickle.loads(data) if kind == PICKLED else data
    if kind == SCALAR:
        return leaves.array(next(position)).item()
    children = [_rebuild_whole(child, leaves, position) for child in structure[2]]
    return container(structure, children, structure[1])


class _Leaves:
    """The leaves of a packed batch in its buffer (a uint8 tensor of shared memory), each
    viewed as a tensor or as a NumPy array, as its kind wants."""

    def __init__(self, buffer: torch.Tensor, placed: Tuple[Tuple[str, Tuple[int, ...], int], ...]):
        self._buffer = buffer
        self._placed = placed

    def _nbytes(self, k: int) -> Tuple[np.dtype, Tuple[int, ...], int, int]:
        dtype, shape, offset = self._placed[k]
        array = np.dtype(dtype)
        return array, shape, offset, array.itemsize * int(np.prod(shape, dtype=np.int64))

    def tensor(self, k: int) -> torch.Tensor:
        dtype, shape, offset, nbytes = self._nbytes(k)
        if not nbytes:
            return torch.from_numpy(np.empty(shape, dtype))
        return self._buffer[offset:offset + nbytes].view(_TORCH_DTYPES[dtype]).reshape(shape)

    def array(self, k: int) -> np.ndarray:
        dtype, shape, offset, nbytes = self._nbytes(k)
        if not nbytes:
            return np.empty(shape, dtype)
        # a view whose base holds the buffer tensor, and with it the shared memory
        return self._buffer[offset:offset + nbytes].numpy().view(dtype).reshape(shape)


def holds_dtype(dtype: np.dtype) -> bool:
    """Whether a tensor can hold NumPy's ``dtype`` (:func:`unpack_whole` can view it)."""
    return dtype in _TORCH_DTYPES


def unpack_whole(tensors: Tuple[Any, Any]) -> Any:
    """A batch packed by :func:`pack_whole` (the source's one-sample batch as tensors), with
    its tensors views of the shared memory."""
    description, buffer = (t[0] for t in tensors)
    layout: PackedLayout = pickle.loads(description.numpy().tobytes())
    return _rebuild_whole(layout.structure, _Leaves(buffer, layout.leaves), iter(range(len(layout.leaves))))
