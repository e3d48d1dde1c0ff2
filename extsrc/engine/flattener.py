"""The worker's side of a sample's structure: :class:`Flattener`, which learns the first
sample's structure and takes the leaves of the next ones without walking them anew.

:func:`~extsrc.engine.structure.flatten` finds a sample's structure by asking each value
what it is, builds the structure's tree, and names every field for the error it might
raise; for a dict of a tensor and a label that took 9 us a sample, as long as the
dataset's own ``__getitem__``. Most datasets return samples of one structure, sample after
sample. :func:`learn` makes a :class:`Plan` of the first sample's structure: each container
checked by its exact type and keys (or length), each leaf by the exact type the first had,
and converted as ``flatten`` converts it. :meth:`Plan.leaves` gives the leaves of a sample
that matches in that order, or ``None`` for any that does not (a new key, another type, a
value to refuse): ``flatten`` then takes it, and says what is wrong where.

Who calls what: a layer's callback calls :class:`Flattener` in the worker (or in the
loop, without workers), once per sample; the consumer's layer rebuilds the batch with
:mod:`extsrc.engine.structure`.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from extsrc.engine.pickling import dumps_classes_by_path
from extsrc.engine.structure import (ARRAY, BYTES, MAPPING, NAMEDTUPLE, NO_FOREIGN_LEAVES, NUMERIC_KINDS, SEQUENCE,
                                     STRING, Bits, ForeignLeaves, Structure, bits_of, canonical, describe, flatten,
                                     str_bytes)

Convert = Callable[[Any], Optional[np.ndarray]]  # a leaf's value -> its array, None: not as learnt


class _Mismatch(Exception):
    """A sample left the learnt structure (raised and caught within :meth:`Plan.leaves`)."""


class _Node:
    """One value of the learnt structure: appends its leaves to ``out``, or raises _Mismatch."""

    def take(self, value: Any, out: List[np.ndarray]) -> None:
        raise NotImplementedError


class _Leaf(_Node):
    def __init__(self, kind: type, convert: Convert):
        self.kind, self.convert = kind, convert

    def take(self, value: Any, out: List[np.ndarray]) -> None:
        kind = type(value)  # not __class__, which a proxy may claim; a name of its own for mypy
        if kind is not self.kind:
            raise _Mismatch
        array = self.convert(value)
        if array is None:
            raise _Mismatch
        out.append(array)


class _Mapping(_Node):
    def __init__(self, kind: type, keys: Tuple[Any, ...], order: Tuple[Any, ...], children: Sequence[_Node]):
        self.kind, self.keys = kind, keys
        self.key_types = tuple(type(key) for key in keys)  # 1 and True are equal keys, not the same
        # The children in the walk's order of the keys, each with where its value is in the dict.
        place = {id(key): position for position, key in enumerate(keys)}  # order holds the same keys
        self.fields = tuple((place[id(key)], child) for key, child in zip(order, children))

    def take(self, value: Any, out: List[np.ndarray]) -> None:
        # The keys in their order, as the structure has them (another order is another structure),
        # of the same types; the values taken by position, not looked up again.
        kind = type(value)
        if kind is not self.kind:
            raise _Mismatch
        keys = tuple(value)
        if keys != self.keys or tuple(map(type, keys)) != self.key_types:
            raise _Mismatch
        values = tuple(value.values())
        for position, child in self.fields:
            child.take(values[position], out)


class _Sequence(_Node):
    def __init__(self, kind: type, children: Sequence[_Node]):
        self.kind, self.children, self.count = kind, tuple(children), len(children)

    def take(self, value: Any, out: List[np.ndarray]) -> None:
        kind = type(value)
        if kind is not self.kind or len(value) != self.count:
            raise _Mismatch
        for child, item in zip(self.children, value):
            child.take(item, out)


def _numeric(value: np.ndarray) -> Optional[np.ndarray]:
    """The leaf as learnt: numeric, in native byte order (else the walk takes it, converting it
    for a layer of :attr:`ForeignLeaves.native` arrays)."""
    dtype = value.dtype
    return value if dtype.kind in NUMERIC_KINDS and dtype.isnative else None


def _foreign(to_array: Callable[[Any, str], np.ndarray]) -> Convert:
    def convert(value: Any) -> Optional[np.ndarray]:
        try:
            array = to_array(value, "")
        except TypeError:
            return None  # flatten() says why, naming the field
        return _numeric(array) if type(array) is np.ndarray else None
    return convert


def _bits(to_bits: Callable[[Any], Optional[Bits]], name: str) -> Convert:
    """A foreign leaf learnt as the bits of the layer's dtype ``name``: another dtype is not as learnt."""
    def convert(value: Any) -> Optional[np.ndarray]:
        bits = to_bits(value)
        return bits[1] if bits is not None and bits[0] == name else None
    return convert


def _scalar(dtype: Any) -> Convert:
    return lambda value: np.asarray(value, dtype)


_CONVERT = {
    np.ndarray: _numeric,
    bool: _scalar(np.bool_), np.bool_: _scalar(np.bool_),
    int: _scalar(np.int64), float: _scalar(np.float64),
    str: lambda value: np.frombuffer(str_bytes(value), np.uint8),
    bytes: lambda value: np.frombuffer(value, np.uint8),
}
_MAPPINGS = (dict, collections.OrderedDict)  # the classes flatten() keeps as they are
_SEQUENCES = (tuple, list)


def _leaf(value: Any, foreign: ForeignLeaves) -> Optional[_Node]:
    kind = type(value)
    convert = _CONVERT.get(kind)
    if convert is None and kind in foreign.types:
        convert = _foreign(foreign.to_array)
    if convert is None and isinstance(value, np.generic) and value.dtype.kind in NUMERIC_KINDS:
        convert = np.asarray  # a NumPy scalar, e.g. np.float32(1.0)
    return None if convert is None else _Leaf(kind, convert)


def _node(structure: Structure, value: Any, foreign: ForeignLeaves) -> Optional[_Node]:
    """The plan of ``value``, whose structure ``flatten`` gave as ``structure``; None where a
    container or leaf is of a type only ``flatten`` handles (a Mapping that is not a dict...)."""
    kind = structure[0]
    bits = bits_of(structure) if kind == ARRAY else None
    if bits is not None:
        return _Leaf(type(value), _bits(foreign.to_bits, bits)) if type(value) in foreign.types else None
    if kind in (ARRAY, STRING, BYTES):
        return _leaf(value, foreign)
    container = type(value)
    if kind == NAMEDTUPLE or (kind == SEQUENCE and container in _SEQUENCES):
        children = _nodes(structure[2], value, foreign)
        return None if children is None else _Sequence(container, children)
    if kind == MAPPING and container in _MAPPINGS:
        _, keys, order = structure[1]
        children = _nodes(structure[2], [value[key] for key in order], foreign)
        return None if children is None else _Mapping(container, keys, order, children)
    return None


def _nodes(structures: Sequence[Structure], values: Sequence[Any], foreign: ForeignLeaves) -> Optional[List[_Node]]:
    """The plans of a container's ``values``, or None if any has none."""
    nodes = []
    for structure, value in zip(structures, values):
        node = _node(structure, value, foreign)
        if node is None:
            return None
        nodes.append(node)
    return nodes


class Plan:
    """The learnt structure of one sample: :meth:`leaves` of samples shaped like it, whose
    structure is ``encoded`` (as the walk's)."""

    def __init__(self, root: _Node, encoded: np.ndarray):
        self._root = root
        self.encoded = encoded

    def leaves(self, sample: Any) -> Optional[List[np.ndarray]]:
        """The leaves of ``sample`` in ``flatten``'s order, if it has the learnt structure
        (the same containers, keys in the same order, leaves of the same types); else None."""
        out: List[np.ndarray] = []
        try:
            self._root.take(sample, out)
        except _Mismatch:
            return None
        return out


def learn(structure: Structure, encoded: np.ndarray, sample: Any, foreign: ForeignLeaves) -> Optional[Plan]:
    """The plan of ``sample``, which ``flatten`` gave ``structure`` (``encoded``: pickled); None
    for a sample with a value of a type the plan does not check (``flatten`` then takes every
    such sample)."""
    root = _node(structure, sample, foreign)
    return None if root is None else Plan(root, encoded)


class Flattener:
    """The worker's side: a sample as ``(structure array, *leaf arrays)``; each structure is
    pickled once per worker, and every sample must have the first one's (but for key order).
    ``advice``: the layer's way out for samples whose structure changes, ending that error."""

    def __init__(self, foreign: ForeignLeaves = NO_FOREIGN_LEAVES, advice: str = "") -> None:
        self._foreign = foreign
        self._advice = advice
        self._encoded: Dict[Structure, np.ndarray] = {}
        self._first: Optional[Structure] = None  # canonical structure of the first sample
        # The first sample's structure, learnt (the Plan above): the samples shaped like it
        # are flattened without a walk; None: not learnt, or not learnable. One attribute,
        # set once: threads of a worker (concurrency > 1) read it while another sets it.
        self._plan: Optional[Plan] = None

    def learned(self, sample: Any) -> Optional[Tuple[np.ndarray, ...]]:
        """``sample`` flattened, if it has the structure learnt from the first sample; else
        None (then :meth:`walk` takes it, and says what is wrong where)."""
        plan = self._plan
        if plan is None:
            return None
        leaves = plan.leaves(sample)
        return None if leaves is None else (plan.encoded, *leaves)

    def __call__(self, sample: Any, where: str) -> Tuple[np.ndarray, ...]:
        """``sample`` flattened: :meth:`learned`, else :meth:`walk`."""
        return self.learned(sample) or self.walk(sample, where)

    def walk(self, sample: Any, where: str) -> Tuple[np.ndarray, ...]:
        """``sample`` flattened by walking it (a caller that tried :meth:`learned` first builds
        ``where`` only then); ``TypeError`` naming ``where`` (e.g. ``"dataset[7]"``) and the
        field for a value the structure cannot carry."""
        leaves: List[np.ndarray] = []
        structure = flatten(sample, leaves, where, foreign=self._foreign)
        encoded = self._encoded.get(structure)
        if encoded is None:
            shape = canonical(structure)
            if self._first is None:
                self._first = shape
            elif shape != self._first:
                raise TypeError(
                    f"{where} is {describe(structure)}, and the first sample this worker loaded "
                    f"{describe(self._first)}: default collation needs the same fields, of the same "
                    f"kinds, in every sample{self._advice}"
                )
            encoded = np.frombuffer(dumps_classes_by_path(structure), np.uint8)
            self._encoded[structure] = encoded
            if len(self._encoded) == 1:  # the first structure: learnt once
                self._plan = learn(structure, encoded, sample, self._foreign)
        return (encoded, *leaves)

    def columns(self, samples: List[Any], where: str) -> Tuple[List[np.ndarray], ...]:
        """A batch of ``samples`` flattened: one list per output (the structures first), the
        samples of the batch ``where`` names in order."""
        flat = [self.learned(sample) or self.walk(sample, f"sample {k} of {where}") for k, sample in enumerate(samples)]
        return tuple(list(column) for column in zip(*flat))
