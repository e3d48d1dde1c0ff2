"""DALI's ``fn`` namespace, with ``external_source`` replaced by extsrc's.

``from extsrc import fn`` gives every DALI operator (``fn.decoders.image``,
``fn.resize``, ``fn.readers.file``, ...) unchanged: attribute access falls
through to ``nvidia.dali.fn``. Only :func:`external_source` differs: with
``parallel=True`` it runs the source on extsrc workers.
"""

from __future__ import annotations

from typing import Any, List

import nvidia.dali.fn as _dali_fn

from extsrc.dali.external_source import external_source

__all__ = ["external_source"]


def __getattr__(name: str) -> Any:
    try:
        return getattr(_dali_fn, name)
    except AttributeError:
        raise AttributeError(f"module 'extsrc.fn' has no attribute {name!r} (nor has nvidia.dali.fn)") from None


def __dir__() -> List[str]:
    return sorted(set(dir(_dali_fn)) | set(globals()))
