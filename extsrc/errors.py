"""Exceptions raised to the consumer of a parallel source.

Every error names where it happened (worker, sample, output) and what was
expected; see the README section "When things go wrong" for real messages.
"""

from __future__ import annotations

import pickle
from typing import Optional, Tuple


class ExtsrcError(Exception):
    """Base class of the errors extsrc raises itself."""


class SampleError(ExtsrcError, ValueError):
    """A callback returned something that is not a valid sample or batch.

    The message names the sample (its ``SampleInfo`` or ``BatchInfo``), the
    output index, what was expected and what came.
    """

    position: int  # set by the engine: the sample's idx_in_batch (see extsrc.engine.samples.at)


class ExhaustedIteratorError(SampleError):
    """A one-pass iterator (e.g. a generator object) was asked for a second epoch."""


class CallbackError(ExtsrcError, RuntimeError):
    """The callback raised an exception that could not be pickled back to the consumer.

    Its message starts with the original exception's type name and message.
    """


class WorkerDiedError(ExtsrcError, RuntimeError):
    """A worker process ended without being asked to (signal, OOM kill, ``os._exit``).

    The message names the worker, its pid, the signal or exit code and the
    samples it held. The pool is shut down: the source cannot be used again.
    ``pid`` is the worker's process id and ``signal`` the number of the signal
    that killed it (``None`` when it exited, or when the backend cannot tell).
    """

    def __init__(self, message: str, pid: Optional[int] = None, signal: Optional[int] = None):
        super().__init__(message)
        self.pid = pid
        self.signal = signal


class SourceTimeoutError(ExtsrcError, TimeoutError, RuntimeError):
    """A batch took longer than the source's ``timeout`` (seconds, the attribute ``timeout``;
    ``None`` where not known); names the stuck samples. Also a ``RuntimeError``, what a
    DataLoader raises when its ``timeout`` passes.

    The pool is shut down: the source cannot be used again.
    """

    def __init__(self, message: str, timeout: Optional[float] = None):
        super().__init__(message)
        self.timeout = timeout


class TooManyErrorsError(ExtsrcError, RuntimeError):
    """More samples of an epoch failed than the source's ``max_errors`` lets pass
    (``on_error="skip"`` or a replacing callable); ``faults`` lists them (each a
    ``SampleFault``: record, batch, error type and message), the message the last ones."""

    def __init__(self, message: str, faults: Tuple[object, ...] = ()):
        super().__init__(message)
        self.faults = faults


class SharedMemoryError(ExtsrcError, OSError, RuntimeError):
    """Shared memory for samples could not be reserved; the message gives the sizes, or the
    descriptor limit that was reached. Also a ``RuntimeError``, what a DataLoader and DALI
    raise when they run out of shared memory or descriptors."""


class SourcePicklingError(ExtsrcError, pickle.PicklingError):
    """The source could not be pickled for ``spawn``/``forkserver`` workers."""


class PoolClosedError(ExtsrcError, RuntimeError):
    """The source or pool was closed, or broke earlier; the message says which."""


class ForkedChildError(ExtsrcError, RuntimeError):
    """A source or pool was used in a process forked from the one that created it.

    Its workers belong to the parent: a child never reads, stops or signals
    them. Create the source in the child instead. Batches the parent held at
    the fork stay readable in the child.
    """


class ForkAfterCudaError(ExtsrcError, RuntimeError):
    """Workers were to be started with ``fork`` after CUDA was initialised in this process.

    A forked worker would inherit a CUDA context it cannot use. Nothing was
    started; the message says how to start the workers first, or to use
    ``spawn``.
    """


class EmptyEpochError(ExtsrcError, ValueError):
    """An epoch produced samples but no batch: all of them were dropped.

    Happens with ``last_batch="drop"`` when the callback ends the epoch
    (``StopIteration``) before ``batch_size`` samples; the message gives the
    counts and the settings that would keep them.
    """


class EpochSupersededError(ExtsrcError, RuntimeError):
    """A loop over a source was ended by a newer ``iter()`` or ``set_state()`` before its end.

    A source serves one loop at a time: two loops (or two loaders) over one
    source would each get only some of the batches, so the older one raises
    this at its next ``next()`` instead of ending quietly.
    """


class StateMismatchError(ExtsrcError, ValueError):
    """``set_state()`` got a state saved by a source that would load other records (another
    batch size, order, shard, or kind of source); the message says what differs."""


class EpochLengthError(ExtsrcError, ValueError):
    """With ``order=``, the callback ended an epoch (``StopIteration``) before the order did.

    The order decides how long an epoch is (``len(source)``); a callback that
    runs out earlier means the two disagree about the data. The message names
    the sample (its ``SampleInfo``, record included) and the order's length.
    """


class OrderWarning(UserWarning):
    """The callback seems to ignore the source's order (``order=``).

    Warned once per source when, under an order that moves records (shuffled
    or sharded), the callback reads ``SampleInfo.idx_in_epoch`` (the position)
    and never ``SampleInfo.record`` (the record the order puts there): it then
    loads the positions in order, unshuffled.
    """


class InternalError(ExtsrcError, RuntimeError):
    """A bug in extsrc itself; the message says where. The pool is shut down."""


class WorkerTraceback(Exception):
    """Carries the traceback text of an exception raised in a worker.

    Set as ``__cause__`` of the exception re-raised in the consumer, so the
    usual traceback printout shows where in the callback it was raised.
    """

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\n" + self.text.rstrip() + "\n"


# The errors that end an epoch at their batch. Any other error of a batch (the callback's, an
# invalid sample) is raised in the batch's place, and the epoch goes on with the next batch.
ENDS_EPOCH = (EpochLengthError, SharedMemoryError)
