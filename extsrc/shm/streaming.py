"""Copies of large samples into a slot that go past the caches.

A slot's memory is written once per lap through the slots and read later by
another process, so a normal copy first reads every destination line into
the cache only to overwrite it. Streaming (non-temporal) stores skip that
read: a cold 4 MiB copy took 110 us instead of 171 us here, and the
large-sample benchmark (4 MiB samples, 2 workers) ran about 1.35x as fast.
glibc's ``memcpy`` uses such stores only above a threshold it derives from
the cache sizes it sees (288 MiB on the 32 MiB-L3 machine measured), so the
worker calls its own copy (``extsrc/shm/_stream.c``) for samples of at least
:data:`STREAM_MIN_BYTES`.

The compiled part is optional: without it (no C compiler at install time, or
``EXTSRC_STREAMING_COPY=0`` in the environment) :func:`copy` is NumPy's
assignment. ``python -m extsrc doctor`` says which is in use.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional, Tuple

import numpy as np

from extsrc.arrays import Array
from extsrc.engine import policy

STREAM_MIN_BYTES = policy.STREAM_MIN_BYTES  # below it, NumPy's copy (see the policy's reason)
ENV_SWITCH = "EXTSRC_STREAMING_COPY"  # "0": always NumPy's copy (to compare, or to rule it out)


def _load() -> Tuple[Optional[ModuleType], str]:
    """The compiled copy, or ``None`` and why not (decided once, at import)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"turned off by {ENV_SWITCH}=0"
    try:
        from extsrc.shm import _stream
    except ImportError:
        return None, ("extsrc.shm._stream was not built (no C compiler or Python headers when "
                      "extsrc was installed); reinstall with them to copy large samples faster")
    if not _stream.STREAMING:
        return None, "this processor architecture has no streaming stores in extsrc's build"
    return _stream, ""


_stream, _why_not = _load()


def available() -> bool:
    """Whether large samples are copied with streaming stores in this process."""
    return _stream is not None


def why_not() -> str:
    """Why :func:`available` is false ("" when it is true), for ``extsrc doctor``."""
    return _why_not


def copy(destination: Array, source: Array) -> None:
    """``destination[...] = source`` for arrays of one dtype and shape; past the caches when
    both are C-contiguous, the copy is at least :data:`STREAM_MIN_BYTES` and the compiled
    part is there. Raises what NumPy's assignment raises for arrays that differ."""
    if (_stream is not None and destination.nbytes >= STREAM_MIN_BYTES
            and destination.shape == source.shape and destination.dtype == source.dtype
            and not destination.dtype.hasobject
            and destination.flags.c_contiguous and source.flags.c_contiguous
            and not np.may_share_memory(destination, source)):  # an overlap needs NumPy's care
        _stream.copy(destination, source)
    else:
        destination[...] = source
