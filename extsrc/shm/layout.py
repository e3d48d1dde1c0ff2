"""Where samples go in a slot: regions for outputs of known layout, and what spilled.

An output whose samples share dtype and shape (its *layout*) gets a region
in the slot's region segment: sample ``k`` of the batch at
``offset + k * stride``, so the batch is one dense array. Layouts are learned
from the first results (:class:`LayoutPlan`); until then, and for samples that
do not match, samples are *spilled* to the writing worker's overflow segment.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import numpy as np

ALIGN = 64  # byte alignment of every region and spilled sample (a cache line)


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def sample_nbytes(dtype_str: str, shape: Tuple[int, ...]) -> int:
    """Bytes of one sample of dtype ``dtype_str`` and ``shape``."""
    nbytes = np.dtype(dtype_str).itemsize
    for extent in shape:
        nbytes *= extent
    return nbytes


class Region(NamedTuple):
    """Where one output's samples of a batch go in the slot's region segment.

    Sample ``k`` of the batch lives at ``offset + k * stride``, so the
    output's samples form one dense array when they all fit.
    """

    offset: int
    dtype: str  # ``np.dtype.str``, e.g. ``"<f4"``
    shape: Tuple[int, ...]

    @property
    def stride(self) -> int:
        return sample_nbytes(self.dtype, self.shape)


class Spilled(NamedTuple):
    """A sample written to the worker's overflow segment of the slot instead of its region."""

    position: int  # idx_in_batch
    dtype: str
    shape: Tuple[int, ...]
    offset: int  # bytes from the start of the overflow segment


Layout = Tuple[str, Tuple[int, ...]]  # (dtype.str, sample shape) shared by an output's samples


class LayoutPlan:
    """The layout of each output as far as known, and the regions that follow from it.

    Owned by a source (consumer side); changed only by :meth:`learn`.
    """

    def __init__(self, num_outputs: int, batch_size: int):
        self.batch_size = batch_size
        self.layouts: List[Optional[Layout]] = [None] * num_outputs
        self.known = False  # until the first samples came back, batches go one at a time
        self._cache: Optional[Tuple[Tuple[Optional[Layout], ...], Tuple[Tuple[Optional[Region], ...], int]]] = None

    @property
    def num_outputs(self) -> int:
        return len(self.layouts)

    def widen(self, num_outputs: int) -> None:
        """The samples have ``num_outputs`` outputs (learnt from the first results), of
        layouts not known yet."""
        self.layouts += [None] * (num_outputs - len(self.layouts))

    def learn(self, output: int, layout: Optional[Layout]) -> None:
        """Output ``output``'s samples share ``layout`` (``None``: they do not)."""
        self.known = True
        self.layouts[output] = layout

    def regions(self) -> Tuple[Tuple[Optional[Region], ...], int]:
        """``(regions per output, bytes of the region segment they take)``; cached per layout."""
        key = tuple(self.layouts)
        if self._cache is None or self._cache[0] != key:
            regions: List[Optional[Region]] = []
            offset = 0
            for layout in self.layouts:
                if layout is None:
                    regions.append(None)
                    continue
                dtype, shape = layout
                regions.append(Region(offset, dtype, shape))
                offset = align(offset + sample_nbytes(dtype, shape) * self.batch_size)
            self._cache = (key, (tuple(regions), offset))
        return self._cache[1]
