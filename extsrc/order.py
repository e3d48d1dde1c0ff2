"""Data order: which records an epoch visits, in which order, on which shard.

:class:`Order` maps a position in this shard's epoch to a record, for any
number of records (up to 2**62), in O(1) memory:

* **Shuffling** is a keyed bijection over ``range(num_records)`` (a
  three-round Feistel network on the smallest even number of bits that covers
  it, walking cycles back into range), keyed by ``(seed, epoch)``: a
  different order every epoch, the same order for the same seed on every
  shard, worker, start method and machine. It is evaluated per position,
  vectorised with NumPy for a task's positions; nothing is materialised.
* **Shards** take every ``count``-th position of the epoch's global order,
  starting at ``index`` (as ``torch.utils.data.DistributedSampler`` does):
  disjoint, and all of the same length. ``remainder="drop"`` gives each shard
  ``num_records // count`` records (the dropped tail differs between epochs
  when shuffling); ``"pad"`` gives each ``ceil(num_records / count)``, the
  shortfall filled with records from the start of the epoch's order.

``shard="auto"`` reads the launcher's environment: ``RANK``/``WORLD_SIZE``
as ``torchrun`` sets them, else JAX's process index and count when JAX is
imported and its distributed runtime initialised, else one shard.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple, TypedDict, Union, overload

import numpy as np

from extsrc.arrays import Array, Int64Array, UInt64Array
from extsrc.checks import is_int

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

REMAINDERS = ("drop", "pad")
MAX_RECORDS = 1 << 62  # positions and records fit int64 on every path

_MASK64 = (1 << 64) - 1
_ROUNDS = 3  # three rounds of a Feistel network make a pseudo-random permutation (Luby-Rackoff)


def _splitmix64(x: int) -> int:
    """A well-mixed 64-bit value from ``x`` (the SplitMix64 finaliser)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _Feistel:
    """A keyed permutation of ``range(size)``, evaluated per element.

    Elements are split into two halves of ``half`` bits; each of the rounds
    maps ``(left, right)`` to ``(right, left ^ F(right))``, where ``F`` takes
    the top ``half`` bits of a 64-bit mix of ``right`` and the round's key
    (xor, multiply, xor-shift, multiply, as in SplitMix64). Values that land at
    or above ``size`` are permuted again until they do not (cycle walking),
    which keeps it a bijection on ``range(size)``; the domain is below
    ``4 * size``, so that takes fewer than four passes on average.
    """

    _M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

    def __init__(self, size: int, key: int):
        bits = max(2, (size - 1).bit_length())
        bits += bits & 1
        self.size = size
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        self.shift = 64 - self.half
        self.keys = [_splitmix64(key + round_) for round_ in range(_ROUNDS)]

    def _f(self, right: int, key: int) -> int:
        z = ((right ^ key) * self._M1) & _MASK64
        z = ((z ^ (z >> 31)) * self._M2) & _MASK64
        return z >> self.shift

    def _once(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._f(right, key)
        return (left << self.half) | right

    def __call__(self, x: int) -> int:
        x = self._once(x)
        while x >= self.size:
            x = self._once(x)
        return x

    def _once_array(self, x: UInt64Array) -> UInt64Array:
        half, shift, m1, m2, s31 = self._half, self._shift, self._m1, self._m2, self._s31
        left: UInt64Array  # (NumPy's stubs leave uint64 arithmetic untyped)
        right: UInt64Array
        left, right = x >> half, x & self._mask
        for key in self._keys:
            z = right ^ key
            z *= m1
            z ^= z >> s31
            z *= m2
            z >>= shift
            z ^= left
            left, right = right, z
        left <<= half
        left |= right
        return left

    def array(self, x: UInt64Array) -> UInt64Array:
        """The permutation of every element of ``x`` (uint64), vectorised."""
        if not hasattr(self, "_keys"):
            self._half, self._shift = np.uint64(self.half), np.uint64(self.shift)
            self._mask, self._size = np.uint64(self.mask), np.uint64(self.size)
            self._m1, self._m2, self._s31 = np.uint64(self._M1), np.uint64(self._M2), np.uint64(31)
            self._keys = [np.uint64(key) for key in self.keys]
        y = self._once_array(x)
        outside = np.flatnonzero(y >= self._size)
        while len(outside):
            again = self._once_array(y[outside])
            y[outside] = again
            outside = outside[again >= self._size]
        return y


def auto_shard() -> Tuple[int, int]:
    """``(index, count)`` from the launcher's environment (see the module docstring)."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is not None or world is not None:
        try:
            index, count = int(rank if rank is not None else ""), int(world if world is not None else "")
        except ValueError:
            raise ValueError(
                f"shard='auto' reads RANK and WORLD_SIZE as torchrun sets them, and got "
                f"RANK={rank!r}, WORLD_SIZE={world!r}; set both to ints with 0 <= RANK < WORLD_SIZE"
            ) from None
        if not 0 <= index < count:
            raise ValueError(f"shard='auto': RANK={index} is not in range(WORLD_SIZE={count})")
        return index, count
    jax = sys.modules.get("jax")
    initialised = getattr(getattr(jax, "distributed", None), "is_initialized", None)
    if jax is not None and initialised is not None and initialised():
        return int(jax.process_index()), int(jax.process_count())
    return 0, 1


class OrderSettings(TypedDict):
    """An order's settings, as :meth:`Order.describe` gives them (JSON-able)."""

    num_records: int
    shuffle: bool
    seed: int
    shard: List[int]  # [index, count]
    remainder: str


class Order:
    """The records of each epoch of this shard, in order (see the module docstring).

    ``Order(num_records, *, shuffle=False, seed=0, shard=None, remainder="drop")``;
    ``shard``: ``None`` (one shard), ``(index, count)``, or ``"auto"``
    (resolved here, once). ``len(order)`` is the number of records per epoch
    of this shard; :meth:`epoch` gives them as a sequence. Picklable, small
    (a few numbers), equal to another with the same settings.
    """

    def __init__(self, num_records: int, *, shuffle: bool = False, seed: int = 0,
                 shard: Union[None, str, Tuple[int, int]] = None, remainder: str = "drop"):
        if not is_int(num_records) or not 1 <= num_records <= MAX_RECORDS:
            raise ValueError(f"num_records must be an int in 1..2**62, got {num_records!r}")
        if not isinstance(shuffle, (bool, np.bool_)):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        if not is_int(seed) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        if remainder not in REMAINDERS:
            raise ValueError(f"remainder must be one of {REMAINDERS}, got {remainder!r}")
        if shard is None:
            index, count = 0, 1
        elif shard == "auto":
            index, count = auto_shard()
        elif (isinstance(shard, (tuple, list)) and len(shard) == 2 and all(map(is_int, shard))
              and 0 <= shard[0] < shard[1]):
            index, count = int(shard[0]), int(shard[1])
        else:
            raise ValueError(
                f"shard must be None, 'auto' or (index, count) with 0 <= index < count, got {shard!r}"
            )
        self.num_records = int(num_records)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.shard = (index, count)
        self.remainder = remainder
        if remainder == "drop":
            self.length = self.num_records // count
        else:
            self.length = -(-self.num_records // count)
        if self.length == 0:
            raise ValueError(
                f"{count} shards of {self.num_records} records with remainder='drop' leave each "
                "shard no record; use remainder='pad' or fewer shards"
            )
        self._permutations: Dict[int, _Feistel] = {}

    # -- what it is --------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.length

    def describe(self) -> OrderSettings:
        """The settings, JSON-able (what a saved state records to check it resumes the same order)."""
        return {"num_records": self.num_records, "shuffle": self.shuffle, "seed": self.seed,
                "shard": list(self.shard), "remainder": self.remainder}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Order) and self.describe() == other.describe()

    def __hash__(self) -> int:
        return hash(tuple(map(str, self.describe().values())))

    def __repr__(self) -> str:
        index, count = self.shard
        return (f"Order({self.num_records}, shuffle={self.shuffle}, seed={self.seed}, "
                f"shard=({index}, {count}), remainder={self.remainder!r})")

    def __getstate__(self) -> Dict[str, object]:
        state = dict(self.__dict__)
        state["_permutations"] = {}
        return state

    # -- records -----------------------------------------------------------------------------

    def _permutation(self, epoch_idx: int) -> _Feistel:
        permutation = self._permutations.get(epoch_idx)
        if permutation is None:
            if len(self._permutations) > 8:  # a handful of epochs in flight at most
                self._permutations.clear()
            permutation = _Feistel(self.num_records, _splitmix64(self.seed) ^ _splitmix64(epoch_idx + 1))
            self._permutations[epoch_idx] = permutation
        return permutation

    def record(self, epoch_idx: int, position: int) -> int:
        """The record at ``position`` (``0 <= position < len(self)``) of epoch ``epoch_idx``."""
        if not 0 <= position < self.length:
            raise IndexError(f"position {position} is outside this shard's epoch of {self.length} records")
        index, count = self.shard
        g = position * count + index
        if g >= self.num_records:  # remainder="pad": from the start of the epoch's order
            g -= self.num_records
        return self._permutation(epoch_idx)(g) if self.shuffle else g

    def records(self, epoch_idx: int, positions: Int64Array) -> Int64Array:
        """The records at ``positions`` (int64 array, each in ``range(len(self))``), vectorised."""
        index, count = self.shard
        g: UInt64Array = positions.astype(np.uint64) * np.uint64(count) + np.uint64(index)
        if self.remainder == "pad":
            g = np.where(g >= np.uint64(self.num_records), g - np.uint64(self.num_records), g)
        if self.shuffle:
            g = self._permutation(epoch_idx).array(g)
        return g.astype(np.int64)

    def epoch(self, epoch_idx: int) -> "EpochOrder":
        """This shard's records of epoch ``epoch_idx``, as a lazy sequence."""
        if not is_int(epoch_idx) or epoch_idx < 0:
            raise ValueError(f"epoch_idx must be an int >= 0, got {epoch_idx!r}")
        return EpochOrder(self, int(epoch_idx), range(self.length))


class RecordCache:
    """A worker's view of an order: records computed a chunk of positions at a time.

    Tasks ask for a few hundred consecutive positions each; computing
    :data:`CHUNK` at once makes the per-record cost negligible (a NumPy call
    costs the same for 200 elements as for 20,000), in :data:`CHUNK` * 8 bytes.
    """

    CHUNK = 1 << 12  # 32 KiB of records, and a few times that while computing them

    def __init__(self, order: Order):
        self.order = order
        self._key: Tuple[int, int] = (-1, -1)  # (epoch, first position of the chunk)
        self._records: Int64Array = np.empty(0, np.int64)

    def get(self, epoch_idx: int, start: int, stop: int) -> List[int]:
        """Records of positions ``start..stop-1`` (each below ``len(order)``) as Python ints."""
        if not self.order.shuffle and self.order.shard == (0, 1):
            return list(range(start, stop))
        first = start - start % self.CHUNK
        if stop <= first + self.CHUNK:
            if self._key != (epoch_idx, first):
                last = min(first + self.CHUNK, len(self.order))
                self._records = self.order.records(epoch_idx, np.arange(first, last, dtype=np.int64))
                self._key = (epoch_idx, first)
            records: List[int] = self._records[start - first:stop - first].tolist()
            return records
        records = self.order.records(epoch_idx, np.arange(start, stop, dtype=np.int64)).tolist()
        return records


class EpochOrder(Sequence[int]):
    """The records of one epoch of one shard: ``len``, indexing, slicing, iteration.

    Nothing is materialised: a slice is another lazy view, an index computes
    one record. ``np.asarray(view)`` materialises (for small views).
    """

    _CHUNK = 1 << 16  # records computed at a time when iterating

    def __init__(self, order: Order, epoch_idx: int, positions: range):
        self.order = order
        self.epoch_idx = epoch_idx
        self.positions = positions

    def __len__(self) -> int:
        return len(self.positions)

    @overload
    def __getitem__(self, item: int) -> int: ...

    @overload
    def __getitem__(self, item: slice) -> "EpochOrder": ...

    def __getitem__(self, item: Union[int, slice]) -> Union[int, "EpochOrder"]:
        if isinstance(item, slice):
            return EpochOrder(self.order, self.epoch_idx, self.positions[item])
        return self.order.record(self.epoch_idx, self.positions[item])

    def __iter__(self) -> Iterator[int]:
        for start in range(0, len(self.positions), self._CHUNK):
            yield from self._array(self.positions[start:start + self._CHUNK]).tolist()

    def _array(self, positions: range) -> Int64Array:
        if len(positions) == 0:
            return np.empty(0, np.int64)
        array = np.arange(positions.start, positions.stop, positions.step, dtype=np.int64)
        return self.order.records(self.epoch_idx, array)

    def __array__(self, dtype: Optional[DTypeLike] = None, copy: Optional[bool] = None) -> Array:
        array = self._array(self.positions)
        return array if dtype is None else array.astype(dtype)

    def __repr__(self) -> str:
        head = ", ".join(str(r) for r in self[:5])
        more = ", ..." if len(self) > 5 else ""
        return f"<epoch {self.epoch_idx} of {self.order!r}: [{head}{more}] ({len(self)} records)>"
