"""extsrc: parallel Python data sources over shared memory, for GPU pipelines.

Core (imports NumPy only): :class:`ParallelSource`, :class:`WorkerPool`, :class:`PoolSpec`,
:class:`Batch`, :class:`SampleInfo`, :class:`BatchInfo`, :class:`Order`, :class:`Hooks`,
:func:`pickle_by_value` and the exceptions in :mod:`extsrc.errors`.

DALI drop-in (imported on first use, needs ``extsrc[dali]``): ``extsrc.fn``,
``extsrc.pipeline_def`` and ``extsrc.Pipeline``, so that ``from extsrc import
fn, pipeline_def, Pipeline`` replaces ``from nvidia.dali import fn,
pipeline_def, Pipeline``.

PyTorch and CuPy (imported on first use): ``extsrc.torch`` (``TorchLoader``,
``from_dataset``) and ``extsrc.cupy`` (``to_device``).
"""

from typing import Any

from extsrc.engine import (
    Batch,
    BatchInfo,
    CallbackError,
    EmptyEpochError,
    EpochLengthError,
    EpochSupersededError,
    ExtsrcError,
    ForkAfterCudaError,
    ForkedChildError,
    Hooks,
    InternalError,
    Order,
    OrderWarning,
    ParallelSource,
    PoolClosedError,
    PoolSpec,
    SampleError,
    SampleFault,
    SampleInfo,
    SharedMemoryError,
    SourcePicklingError,
    SourceTimeoutError,
    StateMismatchError,
    TooManyErrorsError,
    WorkerDiedError,
    WorkerPool,
    pickle_by_value,
)

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BatchInfo",
    "CallbackError",
    "EmptyEpochError",
    "EpochLengthError",
    "EpochSupersededError",
    "ExtsrcError",
    "ForkAfterCudaError",
    "ForkedChildError",
    "Hooks",
    "InternalError",
    "Order",
    "OrderWarning",
    "ParallelSource",
    "PoolClosedError",
    "PoolSpec",
    "SampleError",
    "SampleFault",
    "SampleInfo",
    "SharedMemoryError",
    "SourcePicklingError",
    "SourceTimeoutError",
    "StateMismatchError",
    "TooManyErrorsError",
    "WorkerDiedError",
    "WorkerPool",
    "pickle_by_value",
    "fn",
    "pipeline_def",
    "Pipeline",
]

_DALI_NAMES = ("fn", "pipeline_def", "Pipeline")
_OPTIONAL_MODULES = ("torch", "cupy")  # extsrc.torch, extsrc.cupy: imported on first use


def __getattr__(name: str) -> Any:  # a module, or one of DALI's names
    # The layers are imported by name, so that a type check of the core does not follow into them.
    import importlib

    if name in _DALI_NAMES:
        return getattr(importlib.import_module("extsrc.dali"), name)
    if name in _OPTIONAL_MODULES:
        return importlib.import_module(f"extsrc.{name}")
    raise AttributeError(f"module 'extsrc' has no attribute {name!r}")
