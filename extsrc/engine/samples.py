"""Checking what a callback returned: one sample (or batch) per output, numeric arrays.

Runs in the worker, before anything is written: the consumer only ever sees
arrays of a numeric or bool dtype that match the declared dtype and ndim.
Every error is a :class:`~extsrc.errors.SampleError` naming the sample, the
output, what was expected and what came.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import numpy as np

from extsrc.arrays import Array, DType
from extsrc.errors import SampleError

VALID_KINDS = frozenset("biufc")  # bool, ints, unsigned, floats, complex


def describe_value(value: object) -> str:
    """A short description of a value for an error message."""
    if value is None:
        return "None"
    if isinstance(value, np.ndarray):
        return f"an array of dtype {describe_dtype(value.dtype)} and shape {value.shape}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items {text}"
    return f"{type(value).__name__} {text}"


def describe_dtype(dtype: DType, other: Optional[DType] = None) -> str:
    """``dtype``'s name, with its byte order when that is what tells it from ``other``."""
    if other is not None and dtype != other and dtype.name == other.name:
        order = {"<": "little-endian", ">": "big-endian"}.get(dtype.str[0], "native")
        return f"{dtype.name} ({order}, {dtype.str!r})"
    return str(dtype)


def at(position: int, error: SampleError) -> SampleError:
    """Marks ``error`` with the sample position (idx_in_batch) it belongs to."""
    error.position = position  # lets the consumer order it against an earlier StopIteration
    return error


class _Unfit(Exception):
    """What is wrong with a sample, without the sample's name: the name is made only for an
    error (describing a sample costs microseconds, and ragged samples are each checked)."""


def to_sample_array(
    value: object,
    output: int,
    where: str,
    dtype: Optional[DType] = None,
    ndim: Optional[int] = None,
    num_outputs: Union[None, int, str] = None,  # as declared: None, a count or AUTO_OUTPUTS
) -> Array:
    """``value`` as a sample array, or :class:`SampleError` saying what was expected.

    ``where`` names the sample (``"sample SampleInfo(...)"``). Accepts NumPy
    arrays and anything ``np.asarray`` turns into a numeric or bool array
    (scalars, nested lists of numbers, objects with ``__array__``). Rejects
    ``None``, strings, bytes and object arrays.
    """
    try:
        return _sample_array(value, output, dtype, ndim, num_outputs)
    except _Unfit as exc:
        raise SampleError(f"{where}, {exc}") from None


def _sample_array(value: object, output: int, dtype: Optional[DType], ndim: Optional[int],
                  num_outputs: Union[None, int, str]) -> Array:
    """:func:`to_sample_array` raising :class:`_Unfit` (``"output N: ..."``)."""
    if isinstance(value, np.ndarray):
        array = value
    elif value is None or isinstance(value, (str, bytes, bytearray)):
        hint = " (wrap bytes with np.frombuffer(data, np.uint8))" if isinstance(
            value, (bytes, bytearray)) else ""
        raise _Unfit(f"output {output}: expected a NumPy array of numbers, got "
                     f"{describe_value(value)}{hint}")
    else:
        if (
            num_outputs is None
            and isinstance(value, (tuple, list))
            and any(isinstance(item, np.ndarray) for item in value)
        ):
            raise _Unfit(
                f"output {output}: expected one array, got {describe_value(value)}; "
                f"to return {len(value)} outputs per sample, pass num_outputs={len(value)}"
            )
        try:
            array = np.asarray(value)
        except Exception as exc:
            raise _Unfit(f"output {output}: expected a NumPy array of numbers, got "
                         f"{describe_value(value)} ({type(exc).__name__}: {exc})") from None
    if array.dtype.kind not in VALID_KINDS:
        raise _Unfit(f"output {output}: expected a NumPy array of numbers or bools, got "
                     f"{describe_value(value)} (dtype {array.dtype})")
    if dtype is not None and array.dtype != dtype:
        raise _Unfit(f"output {output}: expected dtype {describe_dtype(dtype, array.dtype)} "
                     f"(as declared), got {describe_dtype(array.dtype, dtype)}")
    if ndim is not None and array.ndim != ndim:
        raise _Unfit(f"output {output}: expected {ndim} dimensions (as declared), got "
                     f"{array.ndim} (shape {array.shape})")
    return array


class SampleChecker:
    """The checks of one source's outputs (declared dtype/ndim), used by the writer."""

    def __init__(self, num_outputs: Union[None, int, str], dtypes: Sequence[Optional[str]],
                 ndims: Sequence[Optional[int]]):
        self.num_outputs = num_outputs
        self.dtypes = tuple(None if d is None else np.dtype(d) for d in dtypes)
        self.ndims = tuple(ndims)

    def check(self, value: object, output: int, position: int, describe: Callable[[int], str],
              first: Optional[Array], first_at: int) -> Array:
        """Sample ``position`` of ``output`` as an array; ``first`` is the first sample of
        the same output in the task, at ``first_at`` (all must share dtype and ndim).
        ``describe`` names a sample by its position, for an error only."""
        try:
            declared = output < len(self.dtypes)  # not with num_outputs="auto"
            array = _sample_array(value, output, self.dtypes[output] if declared else None,
                                  self.ndims[output] if declared else None, self.num_outputs)
        except _Unfit as exc:
            raise at(position, SampleError(f"{describe(position)}, {exc}")) from None
        if first is not None and (array.dtype != first.dtype or array.ndim != first.ndim):
            raise at(position, SampleError(
                f"{describe(position)}, output {output}: expected dtype "
                f"{describe_dtype(first.dtype, array.dtype)} and {first.ndim} dimensions like "
                f"{describe(first_at)}, got dtype {describe_dtype(array.dtype, first.dtype)} with "
                f"shape {array.shape}; all samples of an output in a batch must share dtype and "
                "number of dimensions"
            ))
        return array
