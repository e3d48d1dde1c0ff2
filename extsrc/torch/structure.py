"""A sample's structure: flattened to arrays in a worker, a batch rebuilt as ``default_collate``.

A worker turns each sample (an array, a tensor, a number, a string, or
dicts, tuples, lists and namedtuples of them, nested) into a flat tuple:
its *structure* (a small picklable tree, as a ``uint8`` array) followed by
its leaves as NumPy arrays. The engine carries that tuple through shared
memory (``num_outputs="auto"``: the consumer learns the number of leaves from
the workers' first results, it never reads a sample itself). The consumer
reads the structure of the batch's first sample, checks that the batch's
samples share it, and puts the leaves' tensors back in place, shaped as
``torch.utils.data.default_collate`` shapes them: one tensor per leaf with
the batch along dimension 0 (a list of tensors when the leaf's samples
differ in shape), a list of strings for a string leaf, a dict for a mapping,
a namedtuple for a namedtuple, a list for any other sequence.
"""

from __future__ import annotations

import collections.abc
import io
import pickle
import sys
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from extsrc.engine import attribute_at

# Leaf kinds, and container kinds, in a structure tree. SCALAR and PICKLED only in what a
# user's collate_fn returns (a whole batch): a Python number, and any other object, given back
# as they are.
ARRAY, STRING, BYTES, SCALAR, PICKLED = "array", "str", "bytes", "scalar", "pickled"
LEAVES = frozenset((ARRAY, STRING, BYTES, SCALAR, PICKLED))
MAPPING, NAMEDTUPLE, SEQUENCE = "mapping", "namedtuple", "sequence"

Structure = Tuple[Any, ...]  # (kind,) for a leaf, (kind, type or keys, children) for a container

_NUMERIC_KINDS = frozenset("biufc")


def _error(where: str, what: str) -> TypeError:
    # default_collate's error type, with where in the sample the value was
    return TypeError(f"{where or 'the sample'}: {what}" if where else what)


def _leaf_array(value: Any, where: str) -> np.ndarray:
    """One array, tensor or number as a NumPy array, as default_collate makes it a tensor."""
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise _error(where, f"a tensor on {value.device}; samples must be CPU tensors (the "
                                "workers are processes without CUDA)")
        try:
            array = value.detach().resolve_conj().resolve_neg().numpy()
        except TypeError as exc:
            raise _error(where, f"a {value.dtype} tensor, which NumPy cannot hold ({exc}); "
                                "return another dtype (e.g. tensor.float())") from None
    elif isinstance(value, (bool, np.bool_)):
        array = np.asarray(value, np.bool_)
    elif isinstance(value, int):
        array = np.asarray(value, np.int64)  # default_collate: Python ints make int64
    elif isinstance(value, float):
        array = np.asarray(value, np.float64)  # and Python floats float64
    elif isinstance(value, np.generic):
        array = np.asarray(value)
    else:
        raise _error(where, f"default_collate carries tensors, NumPy arrays, numbers, strings, "
                            f"dicts and sequences, found {type(value)}")
    if array.dtype.kind not in _NUMERIC_KINDS:
        raise _error(where, f"a NumPy array of dtype {array.dtype}; default_collate carries "
                            "numeric and bool arrays only")
    return array


def flatten(sample: Any, leaves: List[np.ndarray], where: str = "", whole: bool = False) -> Structure:
    """Appends the leaves of ``sample`` to ``leaves`` and returns its structure. ``whole``: a
    batch made by a collate_fn, whose numbers and other objects come back as they are."""
    if isinstance(sample, (np.ndarray, torch.Tensor)):
        if not whole or (isinstance(sample, np.ndarray) and sample.dtype.kind in _NUMERIC_KINDS):
            leaves.append(_leaf_array(sample, where))
            return (ARRAY,)
        if isinstance(sample, torch.Tensor) and sample.device.type == "cpu":
            try:
                leaves.append(_leaf_array(sample, where))
                return (ARRAY,)
            except TypeError:
                pass  # a dtype NumPy cannot hold: pickled
        leaves.append(np.frombuffer(pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL), np.uint8))
        return (PICKLED,)
    if isinstance(sample, str):
        leaves.append(np.frombuffer(sample.encode("utf-8"), np.uint8))
        return (STRING,)
    if isinstance(sample, bytes):
        leaves.append(np.frombuffer(sample, np.uint8))
        return (BYTES,)
    if isinstance(sample, collections.abc.Mapping):
        # Leaves in an order of the keys that does not depend on the sample's, so that samples
        # whose keys come in another order still give each output the same field.
        keys = tuple(sample.keys())
        canonical = tuple(sorted(keys, key=repr))
        children = tuple(flatten(sample[k], leaves, f"{where}[{k!r}]", whole) for k in canonical)
        kind = type(sample) if type(sample) in (dict, collections.OrderedDict) else dict
        return (MAPPING, (kind, keys, canonical), children)
    if isinstance(sample, tuple) and hasattr(sample, "_fields"):
        children = tuple(flatten(v, leaves, f"{where}.{f}", whole) for f, v in zip(sample._fields, sample))
        return (NAMEDTUPLE, type(sample), children)
    if isinstance(sample, collections.abc.Sequence):
        children = tuple(flatten(v, leaves, f"{where}[{k}]", whole) for k, v in enumerate(sample))
        return (SEQUENCE, type(sample) if type(sample) in (tuple, list) else list, children)
    if not whole:
        leaves.append(_leaf_array(sample, where))
        return (ARRAY,)
    if isinstance(sample, (bool, int, float)) and not isinstance(sample, np.generic):
        leaves.append(_leaf_array(sample, where))
        return (SCALAR,)
    if isinstance(sample, np.generic) and sample.dtype.kind in _NUMERIC_KINDS:
        leaves.append(np.asarray(sample))
        return (ARRAY,)
    leaves.append(np.frombuffer(pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL), np.uint8))
    return (PICKLED,)


def _canonical(structure: Structure) -> Structure:
    """``structure`` without the order of its dicts' keys."""
    kind = structure[0]
    if kind in LEAVES:
        return structure
    detail = structure[1]
    if kind == MAPPING:
        detail = (detail[0], detail[2])
    return (kind, detail, tuple(_canonical(child) for child in structure[2]))


def _describe(structure: Structure) -> str:
    kind: str = structure[0]
    if kind in LEAVES:
        return {ARRAY: "tensor", STRING: "str", BYTES: "bytes"}.get(kind, kind)
    if kind == MAPPING:
        keys = structure[1][-1]  # the canonical order of the keys, that of the children
        return "{" + ", ".join(f"{k!r}: {_describe(c)}" for k, c in zip(keys, structure[2])) + "}"
    inner = ", ".join(_describe(c) for c in structure[2])
    if kind == NAMEDTUPLE:
        return f"{structure[1].__name__}({inner})"
    return f"({inner})" if structure[1] is tuple else f"[{inner}]"


def _dump_structure(structure: Any) -> bytes:
    """A structure pickled: its namedtuple and mapping classes by reference (by their name, or
    by where their module holds them: a namedtuple made in a class body, or kept under another
    name), or, for a class no module holds (one made inside a function), by value (a class of
    the same name and fields, not the same class)."""
    try:
        buffer = io.BytesIO()
        _ClassByPathPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(structure)
        return buffer.getvalue()
    except (pickle.PicklingError, AttributeError, TypeError):
        from extsrc.engine import DefaultPickler

        return DefaultPickler.dumps(structure)


class _ClassByPathPickler(pickle.Pickler):
    """Pickles a class that its module holds other than under its ``__qualname__`` (e.g.
    ``Pair = namedtuple("Pair", ...)`` in a class body) by that path; pickle alone would fail."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, type) or _held_at(obj.__module__, obj.__qualname__) is obj:
            return NotImplemented
        path = _path_in_module(obj)
        return NotImplemented if path is None else (attribute_at, (obj.__module__, path))


def _held_at(module_name: str, path: str) -> Any:
    """``module_name.path`` (dotted) of an imported module, or ``None`` where there is none."""
    value: Any = sys.modules.get(module_name)
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def _path_in_module(cls: type) -> Optional[str]:
    """Where ``cls``'s module holds it: a module attribute, or one of a module class's."""
    module = sys.modules.get(cls.__module__)
    for name, value in list(vars(module).items()) if module is not None else ():
        if value is cls:
            return name
        if isinstance(value, type):
            for inner, member in list(vars(value).items()):
                if member is cls:
                    return f"{name}.{inner}"
    return None


class Flattener:
    """The worker's side: a sample as ``(structure array, *leaf arrays)``; each structure is
    pickled once per worker."""

    def __init__(self) -> None:
        self._encoded: Dict[Structure, np.ndarray] = {}
        self._first: Optional[Structure] = None  # canonical structure of the first sample

    def __call__(self, sample: Any, where: str) -> Tuple[np.ndarray, ...]:
        """``sample`` flattened; ``TypeError`` naming ``where`` (e.g. ``"dataset[7]"``) and the
        field for a value default collation cannot carry."""
        leaves: List[np.ndarray] = []
        structure = flatten(sample, leaves, where)
        encoded = self._encoded.get(structure)
        if encoded is None:
            canonical = _canonical(structure)
            if self._first is None:
                self._first = canonical
            elif canonical != self._first:
                raise TypeError(
                    f"{where} is {_describe(structure)}, and the first sample this worker loaded "
                    f"{_describe(self._first)}: default collation needs the same fields, of the same "
                    "kinds, in every sample"
                )
            encoded = np.frombuffer(_dump_structure(structure), np.uint8)
            self._encoded[structure] = encoded
        return (encoded, *leaves)

    def columns(self, samples: List[Any], where: str) -> Tuple[List[np.ndarray], ...]:
        """A batch of ``samples`` flattened: one list per output (the structures first), the
        samples of the batch ``where`` names in order."""
        flat = [self(sample, f"sample {k} of {where}") for k, sample in enumerate(samples)]
        return tuple(list(column) for column in zip(*flat))


class Collation:
    """The consumer's side: a batch of flattened samples (their tensors) as default_collate
    gives it. Raises ``TypeError`` when the batch's samples differ in structure (other than in
    the order of a dict's keys: the batch's dicts have the first sample's order, as
    default_collate gives them)."""

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
                self._check_same([self._decode(row.tobytes()) for row in rows])
        else:  # structures of different lengths
            structures = [self._decode(bytes(row.numpy())) for row in encoded]
            self._check_same(structures)
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

    @staticmethod
    def _check_same(structures: List[Structure]) -> None:
        first = _canonical(structures[0])
        for k, structure in enumerate(structures[1:], 1):
            if _canonical(structure) != first:
                raise TypeError(
                    f"sample {k} of the batch differs in structure from sample 0 ({_describe(structure)} "
                    f"and {_describe(structures[0])}): default collation needs the same fields, of "
                    "the same kinds, in every sample"
                )


def _rebuild(structure: Structure, tensors: Tuple[Any, ...], position: Any,
             transposed: bool = False) -> Any:
    kind = structure[0]
    if kind == ARRAY:
        return tensors[next(position)]
    if kind in (STRING, BYTES):
        values = tensors[next(position)]
        rows = [bytes(row.numpy()) for row in values]
        strings = [row.decode("utf-8") for row in rows] if kind == STRING else rows
        # default_collate passes strings on as it got them: a tuple from transposing a
        # sequence's fields, a list for a dict's field or the batch itself.
        return tuple(strings) if transposed else strings
    in_sequence = kind != MAPPING
    children = [_rebuild(child, tensors, position, in_sequence) for child in structure[2]]
    return _container(structure, children, list)


def _rebuild_whole(structure: Structure, leaves: Tuple[Any, ...], position: Any) -> Any:
    """A batch a collate_fn made, as it made it: tensors (views of the shared memory), strings,
    numbers and other objects in the same containers."""
    kind = structure[0]
    if kind == ARRAY:
        return leaves[next(position)]
    if kind in (STRING, BYTES, PICKLED):
        data = bytes(leaves[next(position)].numpy())
        return data.decode("utf-8") if kind == STRING else pickle.loads(data) if kind == PICKLED else data
    if kind == SCALAR:
        return leaves[next(position)].item()
    children = [_rebuild_whole(child, leaves, position) for child in structure[2]]
    return _container(structure, children, structure[1])


def _container(structure: Structure, children: List[Any], sequence_type: Any) -> Any:
    """``children`` in the container ``structure`` describes: a mapping (its keys in their
    order), a namedtuple, or else ``sequence_type(children)``."""
    kind = structure[0]
    if kind == MAPPING:
        mapping_type, keys, canonical = structure[1]
        by_key = dict(zip(canonical, children))
        return mapping_type((key, by_key[key]) for key in keys)
    if kind == NAMEDTUPLE:
        return structure[1](*children)
    return sequence_type(children)


# -- whole batches (made by a collate_fn in the worker) -------------------------------------------
#
# A collate_fn may return any structure, of any number of leaves, batch after batch. Each batch
# travels as one sample of two outputs: its description (structure, and each leaf's dtype, shape
# and offset), and one byte buffer, in shared memory, that the leaves are written into (once).

LEAF_ALIGN = 64  # bytes: each leaf starts on a cache line, and any dtype can view it


class PackedLayout(NamedTuple):
    structure: Structure
    leaves: Tuple[Tuple[str, Tuple[int, ...], int], ...]  # (dtype.str, shape, offset) per leaf


def pack_whole(batch: Any, buffers: Any, where: str) -> Tuple[np.ndarray, np.ndarray]:
    """``batch`` as (description, buffer); ``buffers.array(n, np.uint8, output=1)`` (the
    engine's :class:`~extsrc.engine.runner.SampleBuffers`) gives the buffer in shared memory."""
    leaves: List[np.ndarray] = []
    structure = flatten(batch, leaves, where, whole=True)
    placed = []
    offset = 0
    for leaf in leaves:
        placed.append((leaf.dtype.str, tuple(leaf.shape), offset))
        offset += -(-leaf.nbytes // LEAF_ALIGN) * LEAF_ALIGN
    buffer = buffers.array(offset, np.uint8, output=1)
    for leaf, (_dtype, _shape, start) in zip(leaves, placed):
        if leaf.nbytes:
            target = buffer[start:start + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape)
            np.copyto(target, leaf)
    description = _dump_structure(PackedLayout(structure, tuple(placed)))
    return np.frombuffer(description, np.uint8), buffer


def unpack_whole(tensors: Tuple[Any, Any]) -> Any:
    """A batch packed by :func:`pack_whole` (the source's one-sample batch as tensors), with
    its tensors views of the shared memory."""
    description, buffer = (t[0] for t in tensors)
    layout: PackedLayout = pickle.loads(description.numpy().tobytes())
    leaves = []
    for dtype, shape, offset in layout.leaves:
        array = np.dtype(dtype)
        nbytes = array.itemsize * int(np.prod(shape, dtype=np.int64))
        piece = buffer[offset:offset + nbytes]
        leaves.append(piece.view(_TORCH_DTYPES[array]).reshape(shape) if nbytes else
                      torch.from_numpy(np.empty(shape, array)))
    return _rebuild_whole(layout.structure, tuple(leaves), iter(range(len(leaves))))


_TORCH_DTYPES = {np.dtype(d): torch.from_numpy(np.empty(0, d)).dtype for d in (
    np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128)}
