"""A sample's structure: nested containers flattened to NumPy arrays in a worker.

A worker turns each sample (an array, a number, a string, bytes, or dicts,
tuples, lists and namedtuples of them, nested; a layer adds its own array
kinds, e.g. PyTorch's tensors, as a :class:`ForeignLeaves`) into a flat
tuple: its *structure* (a small picklable tree, as a ``uint8`` array)
followed by its leaves as NumPy arrays. The engine carries that tuple through
shared memory as any other outputs (``num_outputs="auto"``); the consumer's
layer reads the structure back and rebuilds the batch in its own types.

A whole batch made in a worker (a ``collate_fn``'s) may hold anything, of any
number of leaves: :func:`pack_whole` writes its leaves into one buffer and
describes where each lies (a :class:`PackedLayout`).

Who calls what: :class:`~extsrc.engine.flattener.Flattener` (which walks a
sample with :func:`flatten`) and :func:`pack_whole` in the worker, in the
callback; :func:`canonical`, :func:`describe`, :func:`check_same` and
:func:`container` in the consumer, rebuilding a batch.
"""

from __future__ import annotations

import collections.abc
import pickle
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from extsrc.engine.pickling import dumps_classes_by_path

# Leaf kinds, and container kinds, in a structure tree. SCALAR, NDARRAY and PICKLED only in a
# whole batch: a Python number, a NumPy array or scalar, and any other object, given back as
# they are (an ARRAY there is a layer's array, e.g. a tensor).
ARRAY, STRING, BYTES, SCALAR, PICKLED = "array", "str", "bytes", "scalar", "pickled"
NDARRAY = "ndarray"
LEAVES = frozenset((ARRAY, STRING, BYTES, SCALAR, NDARRAY, PICKLED))
MAPPING, NAMEDTUPLE, SEQUENCE = "mapping", "namedtuple", "sequence"
NUMERIC_KINDS = frozenset("biufc")  # NumPy dtype kinds a leaf may have: bool and numbers

Structure = Tuple[Any, ...]  # (kind,) for a leaf, (kind, type or keys, children) for a container


def leaf_error(where: str, what: str) -> TypeError:
    """The error of a value a structure cannot carry, saying where in the sample it was."""
    return TypeError(f"{where}: {what}" if where else what)


Bits = Tuple[str, np.ndarray]  # a layer's dtype NumPy has none for, by name, and its bits


def _no_bits(value: Any) -> Optional[Bits]:
    return None


class ForeignLeaves(NamedTuple):
    """Array kinds a layer knows and the engine does not: values of ``types`` are leaves,
    made NumPy arrays by ``to_array(value, where)``, which raises ``TypeError`` (naming
    ``where``) for one it cannot carry. ``to_bits(value)``: for a value of a dtype NumPy has
    none for (PyTorch's bfloat16), that dtype's name and an array of its bits (an integer
    dtype of the same size), which the leaf's structure names (``(ARRAY, name)``) for the
    consumer's layer to view them as its dtype again; None for any other value. ``native``:
    the layer's arrays hold this machine's byte order only (PyTorch's tensors), so a NumPy
    leaf of the other order is converted in the worker (as ``np.stack`` would in the consumer)."""

    types: Tuple[type, ...]
    to_array: Callable[[Any, str], np.ndarray]
    to_bits: Callable[[Any], Optional[Bits]] = _no_bits
    native: bool = False


def _no_array(value: Any, where: str) -> np.ndarray:
    raise leaf_error(where, f"found {type(value)}")


NO_FOREIGN_LEAVES = ForeignLeaves((), _no_array)  # the engine's own kinds only (picklable)


def bits_of(structure: Structure) -> Optional[str]:
    """The layer's dtype an ``ARRAY`` leaf's array holds the bits of (:class:`ForeignLeaves`), or None."""
    return structure[1] if len(structure) > 1 else None


def leaf_array(value: Any, where: str, foreign: ForeignLeaves = NO_FOREIGN_LEAVES) -> np.ndarray:
    """One array or number as a NumPy array (Python ints as int64, floats as float64)."""
    if isinstance(value, np.ndarray):
        array = value
    elif foreign.types and isinstance(value, foreign.types):
        array = foreign.to_array(value, where)
    elif isinstance(value, (bool, np.bool_)):
        array = np.asarray(value, np.bool_)
    elif isinstance(value, int):
        array = np.asarray(value, np.int64)
    elif isinstance(value, float):
        array = np.asarray(value, np.float64)
    elif isinstance(value, np.generic):
        array = np.asarray(value)
    else:
        raise leaf_error(where, f"a sample's structure carries arrays, numbers, strings, dicts and "
                                f"sequences, found {type(value)}")
    if array.dtype.kind not in NUMERIC_KINDS:
        raise leaf_error(where, f"a NumPy array of dtype {array.dtype}; only numeric and bool "
                                "arrays are carried")
    if foreign.native and not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return array


def _pickled(value: Any, leaves: List[np.ndarray]) -> Structure:
    leaves.append(np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), np.uint8))
    return (PICKLED,)


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _whole_leaf(value: Any, leaves: List[np.ndarray], where: str, foreign: ForeignLeaves) -> Structure:
    """A leaf of a whole batch: a numeric array, else pickled (a dtype NumPy cannot hold, a
    tensor on a device); a Python number comes back as a number, a NumPy array or scalar as
    NumPy's (``(NDARRAY, is_scalar)``), a layer's array as the layer's."""
    if isinstance(value, np.ndarray) and value.dtype.kind not in NUMERIC_KINDS:
        return _pickled(value, leaves)
    if isinstance(value, (bool, int, float)) and not isinstance(value, np.generic):
        if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
            return _pickled(value, leaves)  # a Python int past int64 (a seed, a hash)
        leaves.append(leaf_array(value, where))
        return (SCALAR,)
    if isinstance(value, np.generic) and value.dtype.kind not in NUMERIC_KINDS:
        return _pickled(value, leaves)
    if isinstance(value, (np.ndarray, np.generic)):
        leaves.append(np.asarray(value))
        return (NDARRAY, isinstance(value, np.generic))
    try:
        return _array_leaf(value, leaves, where, foreign)
    except TypeError:
        return _pickled(value, leaves)


def _array_leaf(value: Any, leaves: List[np.ndarray], where: str, foreign: ForeignLeaves) -> Structure:
    """An array or number: ``(ARRAY,)``, or ``(ARRAY, name)`` for a foreign value whose leaf
    holds the bits of the layer's dtype ``name``."""
    bits = foreign.to_bits(value) if foreign.types and isinstance(value, foreign.types) else None
    if bits is not None:
        leaves.append(bits[1])
        return (ARRAY, bits[0])
    leaves.append(leaf_array(value, where, foreign))
    return (ARRAY,)


def str_bytes(value: str) -> bytes:
    """A str as its leaf's bytes: UTF-8, lone surrogates kept (a file name that is not UTF-8,
    as ``os.listdir()`` gives it), so that every str comes back as it was (:func:`bytes_str`)."""
    return value.encode("utf-8", "surrogatepass")


def bytes_str(data: bytes) -> str:
    """The str whose leaf's bytes are ``data`` (:func:`str_bytes`)."""
    return data.decode("utf-8", "surrogatepass")


def flatten(sample: Any, leaves: List[np.ndarray], where: str = "", whole: bool = False,
            foreign: ForeignLeaves = NO_FOREIGN_LEAVES) -> Structure:
    """Appends the leaves of ``sample`` to ``leaves`` and returns its structure. ``whole``: a
    batch made in a worker, whose numbers and other objects come back as they are."""
    if isinstance(sample, str):
        leaves.append(np.frombuffer(str_bytes(sample), np.uint8))
        return (STRING,)
    if isinstance(sample, bytes):
        leaves.append(np.frombuffer(sample, np.uint8))
        return (BYTES,)
    if isinstance(sample, (np.ndarray, np.generic, bool, int, float)) or (
            foreign.types and isinstance(sample, foreign.types)):
        if whole:
            return _whole_leaf(sample, leaves, where, foreign)
        return _array_leaf(sample, leaves, where, foreign)
    if isinstance(sample, collections.abc.Mapping):
        # Leaves in an order of the keys that does not depend on the sample's, so that samples
        # whose keys come in another order still give each output the same field.
        keys = tuple(sample.keys())
        order = tuple(sorted(keys, key=repr))
        children = tuple(flatten(sample[k], leaves, f"{where}[{k!r}]", whole, foreign) for k in order)
        kind = type(sample) if type(sample) in (dict, collections.OrderedDict) else dict
        return (MAPPING, (kind, keys, order), children)
    if isinstance(sample, tuple) and hasattr(sample, "_fields"):
        children = tuple(flatten(v, leaves, f"{where}.{f}", whole, foreign)
                         for f, v in zip(sample._fields, sample))
        return (NAMEDTUPLE, type(sample), children)
    if isinstance(sample, collections.abc.Sequence):
        children = tuple(flatten(v, leaves, f"{where}[{k}]", whole, foreign) for k, v in enumerate(sample))
        return (SEQUENCE, type(sample) if type(sample) in (tuple, list) else list, children)
    if whole:
        return _pickled(sample, leaves)
    raise leaf_error(where, f"a sample's structure carries arrays, numbers, strings, dicts and "
                            f"sequences, found {type(sample)}")


def canonical(structure: Structure) -> Structure:
    """``structure`` without the order of its dicts' keys."""
    kind = structure[0]
    if kind in LEAVES:
        return structure
    detail = structure[1]
    if kind == MAPPING:
        detail = (detail[0], detail[2])
    return (kind, detail, tuple(canonical(child) for child in structure[2]))


def describe(structure: Structure) -> str:
    """``structure`` in a line for an error: ``{'image': array, 'label': array}``."""
    kind: str = structure[0]
    if kind in LEAVES:
        bits = bits_of(structure) if kind == ARRAY else None
        return f"{bits} tensor" if bits else {ARRAY: "tensor", STRING: "str", BYTES: "bytes"}.get(kind, kind)
    if kind == MAPPING:
        keys = structure[1][-1]  # the canonical order of the keys, that of the children
        return "{" + ", ".join(f"{k!r}: {describe(c)}" for k, c in zip(keys, structure[2])) + "}"
    inner = ", ".join(describe(c) for c in structure[2])
    if kind == NAMEDTUPLE:
        return f"{structure[1].__name__}({inner})"
    return f"({inner})" if structure[1] is tuple else f"[{inner}]"


def check_same(structures: Sequence[Structure]) -> None:
    """``TypeError`` if the samples of a batch differ in structure (other than in the order of
    a dict's keys)."""
    first = canonical(structures[0])
    for k, structure in enumerate(structures[1:], 1):
        if canonical(structure) != first:
            raise TypeError(
                f"sample {k} of the batch differs in structure from sample 0 ({describe(structure)} "
                f"and {describe(structures[0])}): default collation needs the same fields, of "
                "the same kinds, in every sample"
            )


def container(structure: Structure, children: List[Any], sequence_type: Any) -> Any:
    """``children`` in the container ``structure`` describes: a mapping (its keys in their
    order), a namedtuple, or else ``sequence_type(children)``."""
    kind = structure[0]
    if kind == MAPPING:
        mapping_type, keys, order = structure[1]
        by_key = dict(zip(order, children))
        return mapping_type((key, by_key[key]) for key in keys)
    if kind == NAMEDTUPLE:
        return structure[1](*children)
    return sequence_type(children)


# -- whole batches ---------------------------------------------------------------------------------
#
# A batch made in a worker may have any structure, of any number of leaves, batch after batch. It
# travels as one sample of two outputs: its description (structure, and each leaf's dtype, shape
# and offset), and one byte buffer, in shared memory, that the leaves are written into (once).

LEAF_ALIGN = 64  # bytes: each leaf starts on a cache line, and any dtype can view it


class PackedLayout(NamedTuple):
    structure: Structure
    leaves: Tuple[Tuple[str, Tuple[int, ...], int], ...]  # (dtype.str, shape, offset) per leaf


class Buffers:
    """Where :func:`pack_whole` gets its buffer: the engine's ``SampleBuffers`` (in place, in
    shared memory) or :data:`HEAP_BUFFERS`."""

    def array(self, nbytes: int, dtype: Any, output: int = 0) -> np.ndarray:
        return np.empty(nbytes, dtype)


HEAP_BUFFERS = Buffers()  # in the worker's memory (in batch mode the engine copies it)


def pack_whole(batch: Any, buffers: Any, where: str,
               foreign: ForeignLeaves = NO_FOREIGN_LEAVES) -> Tuple[np.ndarray, np.ndarray]:
    """``batch`` as (description, buffer); ``buffers.array(n, np.uint8, output=1)`` gives the
    buffer (the engine's ``SampleBuffers`` in shared memory, or :data:`HEAP_BUFFERS`)."""
    leaves: List[np.ndarray] = []
    structure = flatten(batch, leaves, where, whole=True, foreign=foreign)
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
    description = dumps_classes_by_path(PackedLayout(structure, tuple(placed)))
    return np.frombuffer(description, np.uint8), buffer
