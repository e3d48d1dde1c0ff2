"""DALI's dynamic mode, ``nvidia.dali.experimental.dynamic``, with a parallel ExternalSource.

``import extsrc.dynamic as ndd`` replaces ``import
nvidia.dali.experimental.dynamic as ndd``: every name (``ndd.readers``,
``ndd.decoders``, ``ndd.Batch``, ``ndd.checkpoint``, ...) is DALI's, looked
up in DALI's module. Only :class:`ExternalSource` differs: with
``parallel=True`` its source runs on extsrc worker processes and gets a
``SampleInfo`` (or ``BatchInfo``); without it, it is DALI's own class.
Importing this package imports DALI.
"""

from __future__ import annotations

from typing import Any, List

import sys
import types

import nvidia.dali.experimental.dynamic as _ndd

from extsrc.dynamic.external_source import ExternalSource

__all__ = ["ExternalSource"]

# DALI's submodules under this package's name too, so that ``import extsrc.dynamic.checkpoint``
# (and ``from extsrc.dynamic.readers import File``) find what ``ndd.checkpoint`` is.
for _name, _module in list(vars(_ndd).items()):
    if isinstance(_module, types.ModuleType) and _module.__name__ == f"{_ndd.__name__}.{_name}":
        sys.modules.setdefault(f"{__name__}.{_name}", _module)


def __getattr__(name: str) -> Any:
    try:
        return getattr(_ndd, name)
    except AttributeError:
        raise AttributeError(
            f"module 'extsrc.dynamic' has no attribute {name!r} (nor has nvidia.dali.experimental.dynamic)"
        ) from None


def __dir__() -> List[str]:
    return sorted(set(dir(_ndd)) | set(globals()))
