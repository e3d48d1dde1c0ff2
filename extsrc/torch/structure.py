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
import pickle
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

# Leaf kinds, and container kinds, in a structure tree.
ARRAY, STRING, BYTES = "array", "str", "bytes"
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


def flatten(sample: Any, leaves: List[np.ndarray], where: str = "") -> Structure:
    """Appends the leaves of ``sample`` to ``leaves`` and returns its structure."""
    if isinstance(sample, (np.ndarray, torch.Tensor)):
        leaves.append(_leaf_array(sample, where))
        return (ARRAY,)
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
        children = tuple(flatten(sample[k], leaves, f"{where}[{k!r}]") for k in canonical)
        kind = type(sample) if type(sample) in (dict, collections.OrderedDict) else dict
        return (MAPPING, (kind, keys, canonical), children)
    if isinstance(sample, tuple) and hasattr(sample, "_fields"):
        children = tuple(flatten(v, leaves, f"{where}.{f}") for f, v in zip(sample._fields, sample))
        return (NAMEDTUPLE, type(sample), children)
    if isinstance(sample, collections.abc.Sequence):
        children = tuple(flatten(v, leaves, f"{where}[{k}]") for k, v in enumerate(sample))
        return (SEQUENCE, None, children)
    leaves.append(_leaf_array(sample, where))
    return (ARRAY,)


def _canonical(structure: Structure) -> Structure:
    """``structure`` without the order of its dicts' keys."""
    kind = structure[0]
    if kind in (ARRAY, STRING, BYTES):
        return structure
    detail = structure[1]
    if kind == MAPPING:
        detail = (detail[0], detail[2])
    return (kind, detail, tuple(_canonical(child) for child in structure[2]))


def _describe(structure: Structure) -> str:
    kind = structure[0]
    if kind in (ARRAY, STRING, BYTES):
        return {ARRAY: "tensor", STRING: "str", BYTES: "bytes"}[kind]
    if kind == MAPPING:
        keys = structure[1][-1]  # the canonical order of the keys, that of the children
        return "{" + ", ".join(f"{k!r}: {_describe(c)}" for k, c in zip(keys, structure[2])) + "}"
    inner = ", ".join(_describe(c) for c in structure[2])
    return f"{structure[1].__name__}({inner})" if kind == NAMEDTUPLE else f"[{inner}]"


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
            encoded = np.frombuffer(pickle.dumps(structure, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
            self._encoded[structure] = encoded
        return (encoded, *leaves)


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
    if kind == MAPPING:
        mapping_type, keys, canonical = structure[1]
        by_key = dict(zip(canonical, children))
        return mapping_type((key, by_key[key]) for key in keys)
    if kind == NAMEDTUPLE:
        return structure[1](*children)
    return children
