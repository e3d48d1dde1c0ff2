"""The drop-in's default ``py_callback_pickler``: extsrc's, refusing what DALI's refuses.

extsrc's default pickler (cloudpickle) carries by value whatever it cannot
find by its import path. DALI's default carries by value only lambdas, local
functions and functions marked with ``nvidia.dali.pickling.pickle_by_value``,
and refuses a module-level function that cannot be found under its name in
its module (it was renamed, or replaced): it raises ``PicklingError``
("Can't pickle ...: attribute lookup ... failed"). A copy of such a function
would run in the worker with copies of its module's globals, not the module
the worker imports, so the drop-in refuses it as DALI does. Everything else
is extsrc's default (functions of ``__main__`` still travel by value).
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
import types
from typing import Any

from extsrc.engine import DefaultPickler

# The attribute nvidia.dali.pickling.pickle_by_value sets on a function.
DALI_BY_VALUE_MARK = "_dali_pickle_by_value"


def _lost_name(fn: types.FunctionType) -> bool:
    """A module-level function of an imported module (not ``__main__``) that its module does
    not hold under its qualified name."""
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or fn.__name__ == "<lambda>" or fn.__module__ in (None, "__main__"):
        return False
    module = sys.modules.get(fn.__module__)
    if module is None:
        return False
    value: Any = module
    for part in qualname.split("."):
        value = getattr(value, part, None)
        if value is None:
            return True
    return False


@functools.lru_cache(maxsize=None)
def _pickler_class() -> type:
    base = DefaultPickler.pickler_class()

    class _DaliDefault(base):  # type: ignore[misc, valid-type]
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, types.FunctionType):
                if getattr(obj, DALI_BY_VALUE_MARK, False):
                    return self._dynamic_function_reduce(obj)
                if _lost_name(obj):
                    # pickle's own words, which DALI's pickler lets through.
                    raise pickle.PicklingError(
                        f"Can't pickle {obj!r}: attribute lookup {obj.__qualname__} on "
                        f"{obj.__module__} failed (the module has no attribute of that name; mark "
                        "the function with nvidia.dali.pickling.pickle_by_value or "
                        "extsrc.pickle_by_value to send its code instead)"
                    )
            return super().reducer_override(obj)

    return _DaliDefault


class DaliDefaultPickler(DefaultPickler):
    """``py_callback_pickler=None`` of an :class:`extsrc.dali.Pipeline` (see the module doc)."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        buffer = io.BytesIO()
        _pickler_class()(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return buffer.getvalue()
