"""The batch type the consumer receives."""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from extsrc.arrays import Array


class Batch(list[Array]):
    """The samples of one output of one batch: a list of NumPy arrays.

    The arrays are zero-copy views of shared memory. They stay valid and
    unchanged for as long as any of them, or anything made from them (views,
    slices, :meth:`as_array`, ``torch.from_numpy``), is referenced; only then
    is their memory reused. Keeping a batch costs its memory, as a copy would.

    When the samples were written side by side in one region (all samples of
    the output share shape and dtype), :attr:`is_dense` is true and
    :meth:`as_array` returns that region as one array without copying.
    """

    __slots__ = ("_dense",)

    def __init__(self, samples: Iterable[Array] = (), dense: Optional[Array] = None):
        if dense is not None:
            samples = dense
            if dense.ndim == 1 and not dense.dtype.isnative:
                # Samples of shape (): a row of dense is a NumPy scalar, whose byte order is
                # always native; 0-d views keep the samples' dtype (about 60 ns more a sample).
                samples = [dense[k, ...] for k in range(len(dense))]
        super().__init__(samples)
        self._dense = dense

    @property
    def is_dense(self) -> bool:
        """True when :meth:`as_array` returns a view rather than a copy."""
        return self._dense is not None

    def as_array(self) -> Array:
        """The batch as one array of shape ``(len(self), *sample_shape)``.

        A view of shared memory when :attr:`is_dense` (same lifetime as the
        samples), otherwise a new array stacked from the samples. Raises
        ``ValueError`` if the samples differ in shape.
        """
        if self._dense is not None:
            return self._dense
        if not self:
            raise ValueError("an empty batch has no array form")
        first = self[0]
        for k, sample in enumerate(self):
            if sample.shape != first.shape:
                raise ValueError(
                    f"as_array() needs samples of one shape to stack them, and sample {k} has "
                    f"shape {sample.shape} where sample 0 has {first.shape}; iterate over the "
                    "batch for ragged samples, or pad them in the callback"
                )
        # The samples' own dtype when they share it: np.stack alone gives native byte order.
        dtype = first.dtype if all(sample.dtype == first.dtype for sample in self) else None
        return np.stack(self, dtype=dtype)
