"""What DALI's ``fn.external_source`` arguments mean, for a source the engine runs.

DALI accepts as ``source`` a callable (taking nothing, or one argument), an
iterable, or a generator function (also a ``functools.partial`` of one, or an
object whose ``__call__`` is one), and describes outputs with DALI types and
layouts. These helpers tell the kind of a source as DALI does, with DALI's
words in the errors, and translate DALI's ``dtype``/``ndim``/``layout`` into
what the engine checks in its workers.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import numpy as np
from nvidia.dali import types as _dali_types

from extsrc.engine import is_int


def is_generator_function(obj: Any) -> bool:
    """A generator function, a partial of one, or an object whose ``__call__`` is one."""
    if inspect.isgeneratorfunction(obj):
        return True
    if isinstance(obj, functools.partial):
        return is_generator_function(obj.func)
    if obj is None or inspect.isfunction(obj) or inspect.ismethod(obj):
        return False
    call = getattr(obj, "__call__", None)
    if call is None or call is obj:
        return False
    return inspect.isgeneratorfunction(call) or (
        inspect.ismethod(call) and inspect.isgeneratorfunction(call.__func__)
    )


def positional_arg_count(source: Any, most: int = 1) -> int:
    """How many positional arguments a callable source takes (DALI allows at most one;
    ``in_place=True`` sources take a second, the sample buffers)."""
    target = source
    if not (inspect.isfunction(source) or inspect.ismethod(source)) and hasattr(source, "__call__"):
        target = source.__call__
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return 1  # a builtin we cannot inspect: trust it
    count = 0
    allowed = "one positional parameter" if most == 1 else f"{most} positional parameters"
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD, parameter.KEYWORD_ONLY):
            raise TypeError(
                f"source {source!r}: expected a callable with at most {allowed}, got the "
                f"{parameter.kind.description} parameter {parameter.name!r}"
            )
        count += 1
    if count > most:
        if most == 1:
            # DALI's words first, so that a search for DALI's message finds this one.
            raise TypeError(
                "The `source` callable must accept either 0 or 1 positional arguments to indicate "
                "whether it accepts the batch or sample indexing information. Found more than one "
                f"positional argument, which is not allowed. The source {source!r} takes {count}."
            )
        raise TypeError(f"source {source!r}: expected a callable with at most {allowed}, got {count}")
    return count


class GeneratorCall:
    """An iterable over a generator-producing callable: each ``iter()`` calls it anew.

    The engine treats plain generator functions this way; this wrapper gives
    the same treatment to ``functools.partial`` objects and callable objects
    whose ``__call__`` is a generator, as DALI does.
    """

    def __init__(self, make: Any):
        self.make = make

    def __iter__(self):
        return iter(self.make())

    def __repr__(self) -> str:
        return repr(self.make)


def _per_output(value: Any, count: int, fill: Any) -> list:
    """One value per output: a list shorter than ``count`` is padded with ``fill`` (as DALI)."""
    if isinstance(value, (list, tuple)):
        values = list(value)[:count]
        return values + [fill] * (count - len(values))
    return [value] * count


def _numpy_dtype(dtype: Any) -> Optional[np.dtype]:
    """The NumPy dtype for a DALI dtype, or None when the engine should not check it."""
    if dtype is None or not isinstance(dtype, _dali_types.DALIDataType):
        return None  # DALI itself rejects what is not a DALIDataType
    if dtype == _dali_types.DALIDataType.NO_TYPE:
        return None
    try:
        return np.dtype(_dali_types.to_numpy_type(dtype))
    except (KeyError, TypeError):
        return None


def engine_dtypes_ndims(dtype: Any, ndim: Any, layout: Any, num_outputs: Any) -> tuple:
    """``(dtype, ndim)`` for the engine from DALI's ``dtype``, ``ndim`` and ``layout``: one value
    each (``num_outputs`` None), or one list entry per output. DALI pads short lists; it infers
    ``ndim`` from a layout, and so does the engine's check in the workers. A ``num_outputs``
    that is not a positive int is passed on for the engine to refuse."""
    outputs = num_outputs if is_int(num_outputs) and num_outputs >= 1 else 1
    dtypes = [_numpy_dtype(d) for d in _per_output(dtype, outputs, None)]
    ndims = _per_output(ndim, outputs, None)
    layouts = _per_output(layout, outputs, "")
    for j, (n, lay) in enumerate(zip(ndims, layouts)):
        if n is None and isinstance(lay, str) and lay:
            ndims[j] = len(lay)
    if num_outputs is None or outputs != num_outputs:
        return dtypes[0], ndims[0]
    return dtypes, ndims


def source_name(source: Any) -> str:
    """A source's own name: its qualified name, else its name, else its type's."""
    return getattr(source, "__qualname__", None) or getattr(source, "__name__", None) or type(source).__name__


def describe(source: Any) -> str:
    """The engine's name for a source the user did not name: ``external_source(<its name>)``."""
    return f"external_source({source_name(source)})"
