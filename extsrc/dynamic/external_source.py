"""``ndd.ExternalSource`` with ``parallel=True``: the source on extsrc workers, batches from shared memory.

DALI's dynamic-mode ``ExternalSource`` polls a callable without parameters
(or an iterable) in the calling thread. Here, with ``parallel=True``, the
source runs in worker processes as in DALI's parallel ``fn.external_source``:
a callable gets a ``SampleInfo`` (sample mode, the default for a callable) or,
with ``batch=True``, the iteration (a ``BatchInfo`` with ``batch_info=True``);
an iterable or generator function yields whole batches. Each call (eager), or
each step of ``captured(batch_size)`` (capture mode), returns the next batch
of ``batch_size`` samples as an ``ndd.Batch``.

A batch whose samples share shape and dtype is handed to DALI as the shared
memory itself: DALI's batch keeps that memory (and the engine's slot) alive
for as long as it, or a tensor taken from it, is referenced. A batch of
ragged samples is copied once into DALI's memory, because DALI's batch over
separate arrays would not keep them alive.

Everything DALI's class does with what the source returned (``dtype``,
``layout``, ``device``, the ``batch_size`` check, capture mode) is DALI's own
code: this class only replaces the callback it polls. Its position is a
checkpointable state (``get_state``/``set_state``, the contract of
``ndd.checkpoint.Checkpoint.register``).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Optional, Tuple, Union

import nvidia.dali.experimental.dynamic as _ndd
from nvidia.dali.tensors import TensorListCPU

from extsrc.dali.arguments import is_generator_function, source_name
from extsrc.dali.external_source import engine_source
from extsrc.dali.feeder import CYCLE_OFF, CYCLE_QUIET, check_fed, cycle_mode
from extsrc.dali.pickling import DaliDefaultPickler
from extsrc.engine import (UNSET, BatchOutput, ExhaustedIteratorError, Hooks, Order, ParallelSource,
                           PoolSpec, SampleFault, positive_int)

_CALLER = "extsrc.dynamic.ExternalSource"
_PARALLEL_ONLY = ("batch_size", "num_workers", "start_method", "batch", "batch_info", "prefetch",
                  "py_callback_pickler", "order", "last_batch", "concurrency", "timeout", "on_error",
                  "max_errors", "worker_restarts", "batches_held", "name")


class _EitherClass(type):
    """``isinstance(x, extsrc.dynamic.ExternalSource)`` holds for DALI's own instances too (what
    ``ExternalSource(...)`` makes without ``parallel=True``)."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _ndd.ExternalSource)


class ExternalSource(_ndd.ExternalSource, metaclass=_EitherClass):
    """DALI's ``ndd.ExternalSource``; with ``parallel=True`` the source runs on extsrc workers.

    Without ``parallel=True`` the object made is DALI's own
    ``ndd.ExternalSource`` (the parallel-only arguments are then refused).

    With ``parallel=True``: ``batch_size`` (required) samples per call;
    ``num_workers`` (1), ``start_method`` (``"fork"``, as DALI's parallel
    source; start the workers with :meth:`start` before CUDA is initialised)
    and ``py_callback_pickler`` (spawn: how the source travels) make the
    source's worker pool; ``batch`` (sample mode for a callable, batch mode
    for an iterable or generator function), ``batch_info``, ``prefetch``,
    ``order``, ``last_batch``, ``concurrency``, ``timeout``, ``on_error``,
    ``max_errors``, ``worker_restarts``, ``batches_held`` and ``name`` mean
    what they mean for :class:`extsrc.ParallelSource`. ``cycle`` applies to
    iterables as in DALI; a callable ends each epoch with ``StopIteration``
    (or its ``order``'s end), and the next call starts the next epoch.
    """

    _source: ParallelSource

    def __new__(cls, source: Any, num_outputs: int = 1, *, parallel: bool = False,
                **kwargs: Any) -> Any:
        if parallel:
            return super().__new__(cls)
        given = sorted(k for k in kwargs if k in _PARALLEL_ONLY)
        if given:
            raise TypeError(
                f"{_CALLER}: {', '.join(given)} apply to a parallel source; pass parallel=True "
                "(without it this is DALI's own ndd.ExternalSource)"
            )
        return _ndd.ExternalSource(source, num_outputs, **kwargs)

    def __init__(
        self,
        source: Any,
        num_outputs: int = 1,
        *,
        parallel: bool = False,
        batch_size: Optional[int] = None,
        num_workers: int = 1,
        start_method: str = "fork",
        py_callback_pickler: Any = None,
        batch: Optional[bool] = None,
        batch_info: bool = False,
        cycle: Any = None,
        device: Any = "cpu",
        layout: Any = None,
        dtype: Any = None,
        prefetch: Optional[int] = None,
        order: Optional[Order] = None,
        last_batch: str = "drop",
        concurrency: int = 1,
        timeout: Optional[float] = None,
        on_error: Any = "raise",
        max_errors: Union[None, int, float] = None,
        worker_restarts: int = 0,
        batches_held: int = 2,
        name: Optional[str] = None,
    ) -> None:
        if batch_size is None:
            raise TypeError(f"{_CALLER} with parallel=True needs batch_size= (samples per call)")
        positive_int(f"{_CALLER}: batch_size", batch_size)
        self._cycle = cycle_mode(cycle)
        if batch is None:
            batch = not callable(source) or is_generator_function(source)
        runs, self._callable_source = engine_source(source, bool(batch), cycle, self._cycle, False,
                                                    caller=_CALLER)
        if start_method == "fork" and py_callback_pickler is not None:
            raise ValueError(f"{_CALLER}: py_callback_pickler is used only by spawn and forkserver workers")
        self._source = ParallelSource(
            runs, batch_size, num_outputs=None if num_outputs == 1 else num_outputs, batch=bool(batch),
            pool=PoolSpec(num_workers=num_workers, start_method=start_method, worker_restarts=worker_restarts,
                          pickler=(DaliDefaultPickler if py_callback_pickler is None else py_callback_pickler)
                          if start_method != "fork" else UNSET),
            prefetch=prefetch, order=order, last_batch=last_batch, concurrency=concurrency,
            timeout=timeout, on_error=on_error, max_errors=max_errors, batches_held=batches_held,
            name=name if name is not None else f"ndd.ExternalSource({source_name(source)})",
            hooks=Hooks(batch_info=batch_info and bool(batch) and self._callable_source,
                        dense_arrays=True),
        )
        self._batch_size = batch_size
        self._epoch: Any = None  # the engine's running epoch (an iterator), or None between epochs
        self._exhausted = False  # cycle "no" over an iterable: ended for good
        self._lock = threading.Lock()  # for _epoch and _exhausted: threads may call at once
        # DALI's own initialisation, polling this object's next batch instead of the source.
        super().__init__(self._next_outputs, num_outputs, device=device, layout=layout, dtype=dtype)

    # The callback DALI's code polls (eagerly, or from its capture-mode pipeline).
    def _next_outputs(self) -> Union[_ndd.Batch, Tuple[_ndd.Batch, ...]]:
        batch = self._next_batch()
        if self._source.num_outputs is None:
            return _as_dali_batch(batch, 0)
        return tuple(_as_dali_batch(output, j) for j, output in enumerate(batch))

    def _next_batch(self) -> BatchOutput:
        restarted = False  # cycle "quiet": a new pass was begun for this call
        while True:
            with self._lock:
                if self._exhausted:
                    raise StopIteration
                if self._epoch is None:
                    self._epoch = iter(self._source)
                epoch = self._epoch
            try:
                return epoch.__next__()  # not next(): see extsrc.engine's take
            except (StopIteration, ExhaustedIteratorError):
                if not self._after_end(epoch, restarted):
                    raise StopIteration from None
                restarted = True
            except Exception:
                with self._lock:
                    if self._epoch is epoch and not epoch.goes_on():
                        self._epoch = None  # else the epoch goes on after the failed batch
                raise

    def _after_end(self, epoch: Any, restarted: bool) -> bool:
        """``epoch`` ended: whether the call goes on into the next pass (cycle "quiet")."""
        with self._lock:
            if self._epoch is epoch:
                self._epoch = None
                if self._cycle == CYCLE_OFF and not self._callable_source:
                    self._exhausted = True
            # A pass that ended at once would end again: the source gives nothing more.
            return self._cycle == CYCLE_QUIET and not restarted

    # The checkpoint contract of ndd.checkpoint.Checkpoint (as DALI's readers and RNGs).
    def get_state(self, *, cuda_stream: Any = None) -> str:
        """Where the source stands (the next batch a call returns), as a JSON string.

        Raises ``RuntimeError`` in the middle of a captured epoch: DALI's pipeline polls the
        source ahead of the loop's body, so the source's position is not the loop's."""
        captured = self._capture_source is not None or self._captured_iter is not None
        if self._epoch is not None and captured:
            raise RuntimeError(
                f"{_CALLER}: get_state() (a checkpoint) in the middle of a captured epoch would "
                "record a position ahead of the loop: DALI's pipeline polls the source ahead of "
                "the loop's body. Take the checkpoint between captured epochs, or call the "
                "source eagerly (source()) where checkpoints must fall mid-epoch."
            )
        return json.dumps(self._source.get_state(), sort_keys=True)

    def set_state(self, state: Union[str, dict]) -> None:
        """Makes the next call return the batch ``state`` (from :meth:`get_state`) stood at."""
        parsed = json.loads(state) if isinstance(state, str) else state
        self._source.set_state(parsed)
        self._epoch, self._exhausted = None, False

    # The engine's source, for what DALI's class has no word for.
    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def parallel_source(self) -> ParallelSource:
        """The :class:`extsrc.ParallelSource` under this object (``stats()``, ``faults()``, ...)."""
        return self._source

    def start(self) -> None:
        """Starts the workers and the first batches now (before CUDA, when they fork)."""
        self._source.start()

    def stats(self) -> Any:
        return self._source.stats()

    def faults(self) -> list[SampleFault]:
        return self._source.faults()

    def close(self) -> None:
        """Stops the workers and frees the shared memory (batches still held stay valid)."""
        self._epoch = None
        self._source.close()

    def __enter__(self) -> "ExternalSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_dali_batch(samples: Any, output: int) -> _ndd.Batch:
    """DALI's batch over one output: the dense array itself (DALI keeps it alive), else a copy."""
    check_fed(samples, output, _CALLER)  # DALI's TensorList would misread some dtypes silently
    storage = TensorListCPU(samples if not isinstance(samples, list) else list(samples))
    return _ndd.as_batch(storage)  # type: ignore[arg-type]  # its stub omits the TensorList it takes
