"""The engine: sources, the worker pool, workers, and the messages between them.

This package is the engine's one front door. The layers over it (``extsrc.dali``,
``extsrc.torch``, ``extsrc.ray``, ``extsrc.cupy``, ``extsrc.dma``, ``extsrc.cli``)
import what they use from ``extsrc.engine`` itself, never from its modules or
from ``extsrc.shm``; ``tests/test_layout.py`` enforces it, and that the engine
imports no layer. What a layer needs that the engine does not do is a hook it
passes in (:class:`Hooks`), or, for a backend, the protocols it implements
(:class:`WorkerBackend`, :class:`WriterSink`). The engine knows nothing of
DALI, Ray, PyTorch or CuPy. See ``extsrc/README.md`` for the layers and the
life cycle of a batch.
"""

from extsrc.batch import Batch
from extsrc.checks import is_int
from extsrc.closing import close_when_collected
from extsrc.forking import lock as fork_lock
from extsrc.engine.assembly import BatchOutput
from extsrc.engine.backend import (Arrival, Fault, HeldBy, Lost, Received, Wakeable, WorkerBackend,
                                   backend_names, register_backend, unregister_backend)
from extsrc.engine.channel import Channel, OwnedFds
from extsrc.engine.concurrent import is_async
from extsrc.engine.epoch_table import EpochTable
from extsrc.engine.cuda_state import gpu_visible, no_gpu_message
from extsrc.engine.hooks import Hooks, WorkerHooks
from extsrc.engine.kinds import BATCH_CALLABLE, BATCH_GENERATOR, BATCH_ITERABLE, SAMPLE, SourceKind
from extsrc.engine.policy import default_prefetch
from extsrc.engine.pickling import (DefaultPickler, Pickler, PicklerSpec, attribute_at, dumps_classes_by_path,
                                    pickle_by_value)
from extsrc.engine.pool import WorkerPool
from extsrc.engine.processes import setup_failed
from extsrc.engine.protocol import (AddSlot, DropSlot, Result, SetupFailed, SourceSetup, Task, TaskDone,
                                    TaskFailed)
from extsrc.engine.faults import SampleFault
from extsrc.engine.runner import SourceRunner, failure, load_source, slot_writer
from extsrc.engine.samples import SampleChecker, describe_dtype
from extsrc.engine.sink import TaskSink, WriterSink
from extsrc.engine.position import LoopPosition
from extsrc.engine.refill import Refill
from extsrc.engine.stats import usable_cpus
from extsrc.engine.source import ParallelSource, parse_state
from extsrc.engine.flattener import Flattener
from extsrc.engine.structure import (ARRAY, BYTES, HEAP_BUFFERS, MAPPING, NDARRAY, PICKLED, SCALAR, STRING, Bits,
                                     ForeignLeaves, NUMERIC_KINDS, PackedLayout, Structure, bits_of, check_same,
                                     bytes_str, container, leaf_error, pack_whole, str_bytes)
from extsrc.engine.take import Cursor, first_ready
from extsrc.engine.threads import OwnedThread
from extsrc.engine.spec import (AUTO_OUTPUTS, START_METHODS, UNSET, PoolSpec, SourceSpec, check_backend,
                                non_negative_int, non_negative_number, positive_int)
from extsrc.engine.worker import serve
from extsrc.errors import (CallbackError, EmptyEpochError, EpochLengthError, EpochSupersededError,
                           ExhaustedIteratorError, ExtsrcError, ForkAfterCudaError, ForkedChildError,
                           InternalError, OrderWarning, PoolClosedError, SampleError, SharedMemoryError,
                           SourcePicklingError, SourceTimeoutError, StateMismatchError,
                           TooManyErrorsError, WorkerDiedError)
from extsrc.order import Order, RecordCache
from extsrc.sample_info import BatchInfo, SampleInfo
from extsrc.shm import limits, streaming
from extsrc.shm.segment import Segment
from extsrc.shm.segment import backend as shm_backend

__all__ = [
    # sources and pools
    "ParallelSource", "Refill", "WorkerPool", "Batch", "BatchOutput", "SampleInfo", "BatchInfo", "Order",
    "RecordCache", "EpochTable", "SampleFault", "Cursor", "LoopPosition", "first_ready", "parse_state",
    # nested samples flattened in a worker, rebuilt by a layer
    "Flattener", "ForeignLeaves", "Bits", "bits_of", "Structure", "PackedLayout", "pack_whole", "HEAP_BUFFERS",
    "check_same", "container", "leaf_error", "str_bytes", "bytes_str", "NUMERIC_KINDS",
    "ARRAY", "STRING", "BYTES", "SCALAR", "NDARRAY", "PICKLED", "MAPPING",
    # what describes a source and a pool
    "SourceSpec", "PoolSpec", "AUTO_OUTPUTS", "START_METHODS", "UNSET",
    "SourceKind", "SAMPLE", "BATCH_CALLABLE", "BATCH_ITERABLE", "BATCH_GENERATOR",
    # what a layer passes in
    "Hooks", "WorkerHooks", "Pickler", "PicklerSpec", "DefaultPickler", "pickle_by_value",
    "attribute_at", "dumps_classes_by_path", "is_async", "default_prefetch", "usable_cpus",
    # checks a layer's own arguments reuse, and the words of its errors
    "positive_int", "non_negative_int", "non_negative_number", "is_int", "check_backend", "describe_dtype",
    # backends: the protocol, the writer seam, what a worker runs
    "WorkerBackend", "Arrival", "Fault", "HeldBy", "Lost", "Received", "Wakeable", "register_backend",
    "unregister_backend", "backend_names", "setup_failed", "Channel", "OwnedFds", "AddSlot",
    "DropSlot", "Result", "SetupFailed", "SourceSetup", "Task", "TaskDone", "TaskFailed",
    "SourceRunner", "load_source", "slot_writer", "failure", "serve", "SampleChecker",
    "TaskSink", "WriterSink",
    # the process, its memory and the GPU
    "close_when_collected", "fork_lock", "OwnedThread", "gpu_visible", "no_gpu_message", "limits", "streaming",
    "Segment", "shm_backend",
    # errors
    "CallbackError", "EmptyEpochError", "EpochLengthError", "EpochSupersededError",
    "ExhaustedIteratorError", "ExtsrcError", "ForkAfterCudaError", "ForkedChildError",
    "InternalError", "OrderWarning", "PoolClosedError", "SampleError", "SharedMemoryError",
    "SourcePicklingError", "SourceTimeoutError", "StateMismatchError", "TooManyErrorsError", "WorkerDiedError",
]
