"""The batch type the consumer receives."""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np


class Batch(list):
    """The samples of one output of one batch: a list of NumPy arrays.

    The arrays are zero-copy views of shared memory. They are valid until the
    source has handed out ``batches_held`` newer batches (by default: while the
    consumer takes the following batch); after that their memory is reused, so
    copy what must live longer.

    When the samples were written side by side in one region (all samples of
    the output share shape and dtype), :attr:`is_dense` is true and
    :meth:`as_array` returns that region as one array without copying.
    """

    __slots__ = ("_dense",)

    def __init__(self, samples: Iterable[np.ndarray] = (), dense: Optional[np.ndarray] = None):
        super().__init__(dense if dense is not None else samples)
        self._dense = dense

    @property
    def is_dense(self) -> bool:
        """True when :meth:`as_array` returns a view rather than a copy."""
        return self._dense is not None

    def as_array(self) -> np.ndarray:
        """The batch as one array of shape ``(len(self), *sample_shape)``.

        A view of shared memory when :attr:`is_dense` (same lifetime as the
        samples), otherwise a new array stacked from the samples. Raises
        ``ValueError`` if the samples differ in shape.
        """
        if self._dense is not None:
            return self._dense
        if not self:
            raise ValueError("an empty batch has no array form")
        return np.stack(self)
