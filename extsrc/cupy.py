"""CuPy on extsrc: batches copied to the GPU asynchronously, from page-locked shared memory.

```python
import extsrc.cupy

source = extsrc.ParallelSource(load, 64, num_workers=8)
source.start()                       # fork workers before CUDA is initialised
extsrc.cupy.page_lock(source)        # once: the shared memory becomes pinned, copies are DMAs
stream = cupy.cuda.Stream(non_blocking=True)
for batch in source:
    images = extsrc.cupy.to_device(batch, stream)   # queued on `stream`, returns at once
    stream.synchronize()             # or make another stream wait on it
    tensor = torch.from_dlpack(images)              # PyTorch (or JAX) view, no copy
```

CuPy is imported on first use (``pip install 'extsrc[cupy]'``); this module
imports without it.
"""

from __future__ import annotations

import weakref
from typing import Any, List

import numpy as np

from extsrc.dma import CUDA_HOST_REGISTER_PORTABLE, InFlight, PageLock
from extsrc.dma import page_lock as _page_lock
from extsrc.engine import Batch, ParallelSource, gpu_visible

_in_flight = InFlight()  # host arrays of copies queued by to_device, until each has completed
_page_locks: "weakref.WeakSet[PageLock]" = weakref.WeakSet()


_checked: List[Any] = []  # CuPy, once it was found with a usable GPU


def _cupy() -> Any:
    if _checked:
        return _checked[0]
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(
            f"extsrc.cupy needs CuPy, which is not importable here ({exc}); install it with "
            "pip install 'extsrc[cupy]' (cupy-cuda12x) on a machine with CUDA 12"
        ) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy_backends.cuda.api.runtime.CUDARuntimeError and kin
        count, why = 0, f"{type(exc).__name__}: {exc}"
    else:
        why = gpu_visible()[1] or "CUDA reports no device"
    if count < 1:
        raise RuntimeError(f"extsrc.cupy needs a CUDA GPU, and none is usable here ({why})")
    _checked.append(cupy)
    return cupy


def page_lock(source: ParallelSource) -> PageLock:
    """Registers ``source``'s shared memory with CUDA as page-locked, once, for the current device.

    Every mapping is registered as it is made and unregistered right before
    it is unmapped; copies of its batches by :func:`to_device` are then DMAs
    that the CPU does not wait for. Starts the source's workers first (with
    ``fork`` they must start before CUDA is initialised). Idempotent per
    source (also across PyTorch's ``TorchLoader(pin_memory=True)``). Raises
    ``ImportError`` without CuPy and ``RuntimeError`` without a GPU; a failed
    registration is raised by the next :func:`to_device`.
    """
    source.start()
    cupy = _cupy()
    index = cupy.cuda.Device().id
    runtime = cupy.cuda.runtime

    def register(address: int, size: int) -> None:
        with cupy.cuda.Device(index):  # the mapping thread may have another device current
            runtime.hostRegister(address, size, CUDA_HOST_REGISTER_PORTABLE)

    def unregister(address: int) -> None:
        with cupy.cuda.Device(index):
            runtime.hostUnregister(address)

    lock = _page_lock(source, "CuPy", register, unregister)
    _page_locks.add(lock)
    return lock


def _host_arrays(batch: Any) -> Any:
    """The arrays to copy, in the shape of the result: an array per dense output, a list of
    arrays per ragged one, a tuple of those for several outputs."""
    if isinstance(batch, tuple):
        return tuple(_host_arrays(output) for output in batch)
    if isinstance(batch, Batch):
        return batch.as_array() if batch.is_dense else list(batch)
    if isinstance(batch, np.ndarray):
        return batch
    if isinstance(batch, list) and all(isinstance(a, np.ndarray) for a in batch):
        return list(batch)
    raise TypeError(
        f"to_device takes a batch of an extsrc source (a Batch, or a tuple of them) or NumPy "
        f"arrays, got {type(batch).__name__}"
    )


def to_device(batch: Any, stream: Any = None) -> Any:
    """CuPy arrays with the contents of ``batch``, copied on ``stream`` (a ``cupy.cuda.Stream``;
    default: the current stream).

    ``batch``: what a source yields (a :class:`~extsrc.Batch`, or a tuple of
    them), or NumPy arrays. The result has its shape: one CuPy array per dense
    output (``(batch, *sample_shape)``), a list of arrays per ragged output,
    a tuple for several outputs. The copies are queued and the call returns:
    use the arrays on ``stream`` (or after ``stream.synchronize()``, or make
    another stream wait for it). From memory registered by :func:`page_lock`
    the copies are DMAs; from other memory CUDA stages them on the CPU.

    The host arrays stay referenced here until their copies have completed
    (checked at every call, and by :func:`wait`), so the engine does not reuse
    their memory while a copy reads it; drop the batch whenever you like.
    ``torch.from_dlpack(array)`` (or ``jax.dlpack.from_dlpack``) gives a
    tensor over the same GPU memory.
    """
    cupy = _cupy()
    for lock in list(_page_locks):
        lock.check()
    _in_flight.release_done()
    host = _host_arrays(batch)
    stream = stream if stream is not None else cupy.cuda.get_current_stream()
    kept: List[np.ndarray] = []

    def copy(array: np.ndarray) -> Any:
        array = np.ascontiguousarray(array)  # a view already, for the engine's arrays
        kept.append(array)
        device = cupy.empty(array.shape, array.dtype)
        device.set(array, stream=stream)
        return device

    with stream:  # the memory pool hands out memory ordered on this stream
        result = _map_arrays(copy, host)
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
    _in_flight.add(event, (kept, batch))
    return result


def _map_arrays(function: Any, value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return function(value)
    return type(value)(_map_arrays(function, v) for v in value)


def wait() -> None:
    """Waits for every copy queued by :func:`to_device` and drops its host arrays."""
    _in_flight.wait_all()


def copies_in_flight() -> int:
    """Host batches :func:`to_device` still keeps for copies not known to have completed."""
    return len(_in_flight)

