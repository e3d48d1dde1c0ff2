"""The annotations of NumPy arrays and dtypes, shared by the engine and its types.

``Array`` is an array of any shape and dtype (a sample, a batch's dense output, a
view of shared memory) and ``DType`` any dtype; ``Int64Array`` and ``UInt64Array``
are the arrays of positions and records of :mod:`extsrc.order`.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import numpy as np

Array: TypeAlias = np.ndarray[Any, np.dtype[Any]]
DType: TypeAlias = np.dtype[Any]
Int64Array: TypeAlias = np.ndarray[Any, np.dtype[np.int64]]
UInt64Array: TypeAlias = np.ndarray[Any, np.dtype[np.uint64]]
