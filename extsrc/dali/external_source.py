"""``external_source`` for DALI pipelines, with ``parallel=True`` served by the extsrc engine.

How a parallel external source is wired (see README.md next to this file):

* at definition time a :class:`~extsrc.ParallelSource` is created on the
  pipeline's one :class:`~extsrc.WorkerPool`, and DALI gets an ordinary
  (non-parallel) batch external source whose callback is a :class:`_Feeder`;
* DALI calls the feeder once per iteration with ``BatchInfo(iteration,
  epoch_idx)``, in its own thread, exactly when it would call a plain
  callback; the feeder takes the next batch of the engine's epoch and hands
  it over without copying (``no_copy=True``: one dense array when the batch
  is dense, else the list of sample arrays);
* DALI's iteration and epoch numbers are the only truth about *which* batch
  is wanted: when they are not the next batch of the engine's running epoch
  (first call, ``reset()``, a restored checkpoint, an epoch cut short by
  another source), the feeder moves the engine there with ``set_state()``.

Everything without ``parallel=True`` goes to DALI's own ``external_source``
untouched.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections import deque
from typing import Any, Deque, Optional

import numpy as np
import nvidia.dali.fn as _dali_fn
from nvidia.dali import types as _dali_types
from nvidia.dali.pipeline import Pipeline as _DaliPipeline

from extsrc.batch import Batch
from extsrc.engine.runner import ExhaustedIteratorError
from extsrc.engine.source import ParallelSource
from extsrc.options import LAST_BATCH_POLICIES, default_prefetch
from extsrc.order import Order

_CYCLE_OFF = "no"
_CYCLE_RAISE = "raise"
_CYCLE_QUIET = "quiet"


def _cycle_mode(cycle: Any) -> str:
    if cycle is None or cycle is False or cycle == "no":
        return _CYCLE_OFF
    if cycle is True or cycle == "quiet":
        return _CYCLE_QUIET
    if cycle == "raise":
        return _CYCLE_RAISE
    raise ValueError(
        f'cycle must be "no" (or False/None), "quiet" (or True) or "raise"; got {cycle!r}'
    )


def _is_generator_function(obj: Any) -> bool:
    """A generator function, a partial of one, or an object whose ``__call__`` is one."""
    if inspect.isgeneratorfunction(obj):
        return True
    if isinstance(obj, functools.partial):
        return _is_generator_function(obj.func)
    if obj is None or inspect.isfunction(obj) or inspect.ismethod(obj):
        return False
    call = getattr(obj, "__call__", None)
    if call is None or call is obj:
        return False
    return inspect.isgeneratorfunction(call) or (
        inspect.ismethod(call) and inspect.isgeneratorfunction(call.__func__)
    )


def _positional_arg_count(source: Any, most: int = 1) -> int:
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


class _GeneratorCall:
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


def _engine_dtypes_ndims(dtype: Any, ndim: Any, layout: Any, outputs: int, multi: bool):
    dtypes = [_numpy_dtype(d) for d in _per_output(dtype, outputs, None)]
    ndims = _per_output(ndim, outputs, None)
    layouts = _per_output(layout, outputs, "")
    for j, (n, lay) in enumerate(zip(ndims, layouts)):
        if n is None and isinstance(lay, str) and lay:
            ndims[j] = len(lay)  # DALI infers ndim from the layout; check it in the worker too
    if not multi:
        return dtypes[0], ndims[0]
    return dtypes, ndims


def _describe(source: Any) -> str:
    name = getattr(source, "__qualname__", None) or getattr(source, "__name__", None)
    if name is None:
        name = type(source).__name__
    return f"external_source({name})"


def _to_dali(samples: Batch) -> Any:
    """What DALI is fed for one output: the dense array (a view), else the list of views."""
    if samples.is_dense:
        return samples.as_array()
    return list(samples)


class _Feeder:
    """The callback DALI calls (non-parallel, batch mode, ``batch_info=True``).

    Keeps the engine's epoch in step with DALI's ``BatchInfo`` and a reference
    to the last ``keep`` batches it handed to DALI, so that the memory behind
    a zero-copy feed stays mapped for as long as the engine keeps it unchanged.
    """

    def __init__(self, source: ParallelSource, callable_source: bool, cycle: str, keep: int, original: Any,
                 name: Optional[str] = None):
        self.source = source
        self.name = name  # the user's name=, for reader_meta(name) (DALI's iterators' reader_name=)
        self.cycle = cycle
        self.original = original
        self.callable_source = callable_source
        self._epoch: Any = None  # iterator of the engine's running epoch
        self._expected: Optional[tuple] = None  # (epoch_idx, iteration) it will yield next
        self._exhausted = False  # cycle "no" over an iterable: ended for good
        self._kept: Deque[Any] = deque(maxlen=keep)

    def __repr__(self) -> str:
        return f"extsrc parallel source {self.original!r}"

    def __call__(self, info: Any) -> Any:
        """``info``: DALI's ``BatchInfo`` of the batch it wants now."""
        position = (info.epoch_idx, info.iteration)
        if self._exhausted:
            raise StopIteration
        # A callable follows DALI's numbers. An iterable or generator is one stream, as in DALI:
        # a reset() caused by another source's end does not rewind it (it goes on where it
        # was); only its own end starts its next pass (see _after_end).
        if self._epoch is None or (self.callable_source and position != self._expected):
            self._restart(position)
        try:
            batch = self._epoch.__next__()  # not next(): see extsrc.engine.take
        except (StopIteration, ExhaustedIteratorError):
            # An iterator that did not start a new pass when iterated again gives DALI an empty
            # epoch (as DALI's own parallel source does), not an error.
            batch = self._after_end(position)
        except Exception:
            self._epoch, self._expected = None, None  # next call resumes at DALI's position
            raise
        # An interrupt (KeyboardInterrupt) above leaves the engine's epoch holding the batch for
        # the next call (extsrc.engine.take): nothing to restart.
        self._expected = (position[0], position[1] + 1)
        self._kept.append(batch)
        if self.source.num_outputs is None:
            return _to_dali(batch)
        return tuple(_to_dali(samples) for samples in batch)

    def _restart(self, position: tuple) -> None:
        epoch_idx, iteration = position
        if not self.callable_source:
            iteration = 0  # an iterator cannot be rewound: it restarts (DALI warns at definition)
        self.source.set_state({"epoch_idx": epoch_idx, "iteration": iteration})
        self._epoch = iter(self.source)

    def _after_end(self, position: tuple) -> Any:
        epoch_idx = position[0]
        if self.cycle == _CYCLE_QUIET:
            # Rewind at once, invisibly to DALI: the next engine epoch continues this one.
            self._epoch = iter(self.source)
            try:
                return self._epoch.__next__()
            except (StopIteration, ExhaustedIteratorError):
                self._epoch, self._expected = None, None
                raise StopIteration from None
        self._epoch, self._expected = None, None
        if self.cycle == _CYCLE_OFF and not self.callable_source:
            self._exhausted = True
            raise StopIteration
        # Start producing DALI's next epoch now: reset() will ask for (epoch + 1, 0).
        try:
            self.source.set_state({"epoch_idx": epoch_idx + 1, "iteration": 0})
            self._epoch = iter(self.source)
            self._expected = (epoch_idx + 1, 0)
        except Exception:
            self._epoch, self._expected = None, None  # the error comes back at the next call
        raise StopIteration

    def release(self) -> None:
        """Drops the references to fed batches (after DALI stopped reading them)."""
        self._kept.clear()
        self._epoch, self._expected = None, None


def _current_extsrc_pipeline(caller: str):
    from extsrc.dali.pipeline import Pipeline

    pipe = _DaliPipeline.current()
    if pipe is None:
        _DaliPipeline._raise_pipeline_required(caller)
    if not isinstance(pipe, Pipeline):
        raise TypeError(
            f"{caller} with parallel=True runs on extsrc workers and needs a pipeline created "
            "by extsrc.pipeline_def (or extsrc.dali.Pipeline); the current pipeline is a "
            f"{type(pipe).__module__}.{type(pipe).__name__}. Change "
            "`from nvidia.dali import pipeline_def` to `from extsrc import pipeline_def`."
        )
    return pipe


def external_source(
    source: Any = None,
    num_outputs: Optional[int] = None,
    *,
    cycle: Any = None,
    name: Optional[str] = None,
    device: str = "cpu",
    layout: Any = None,
    dtype: Any = None,
    ndim: Any = None,
    cuda_stream: Any = None,
    use_copy_kernel: Optional[bool] = None,
    blocking: Optional[bool] = None,
    batch: Optional[bool] = None,
    repeat_last: bool = False,
    parallel: Optional[bool] = None,
    no_copy: Optional[bool] = None,
    prefetch_queue_depth: Optional[int] = None,
    bytes_per_sample_hint: Optional[int] = None,
    batch_info: Optional[bool] = None,
    last_batch: str = "drop",
    timeout: Optional[float] = None,
    order: Optional[Order] = None,
    in_place: bool = False,
    stats_every: Optional[float] = None,
    concurrency: int = 1,
    **kwargs: Any,
):
    """DALI's ``fn.external_source``; with ``parallel=True`` the source runs on extsrc workers.

    Without ``parallel=True`` this is exactly ``nvidia.dali.fn.external_source``
    (every argument is passed on; ``last_batch`` and ``timeout`` must then stay
    at their defaults).

    With ``parallel=True`` the pipeline must come from
    :func:`extsrc.pipeline_def` (or :class:`extsrc.dali.Pipeline`); its
    ``py_num_workers``, ``py_start_method`` and ``py_callback_pickler`` set up
    one extsrc :class:`~extsrc.WorkerPool` shared by all its parallel sources.
    ``batch`` defaults to True, as in DALI's ``fn.external_source``: the source
    is a callable taking the iteration (or ``BatchInfo`` with
    ``batch_info=True``), an iterable or a generator function, and returns
    whole batches; with ``batch=False`` (sample mode) ``source(SampleInfo)``
    returns a sample, or a tuple of ``num_outputs`` samples. With ``order=`` or
    ``in_place=True`` (sample mode only) ``batch`` defaults to False.

    An iterable or generator is one stream, as in DALI: a ``reset()`` caused
    by another source's end does not rewind it; after its own end it is
    iterated again (``iter()``) for the next epoch, and one that does not
    start a new pass then gives empty epochs. ``cycle`` ("no", "raise",
    "quiet") applies to iterables and generator functions as in DALI. ``prefetch_queue_depth`` is the number of
    batches the workers prepare ahead (default: two per worker, at least the
    pipeline's ``prefetch_queue_depth``); ``bytes_per_sample_hint`` is
    accepted and not needed (the engine sizes its memory from the first
    batch).

    ``name`` may be given with ``num_outputs`` (DALI allows one or the
    other): it names the source for :meth:`extsrc.dali.Pipeline.reader_meta`,
    so that DALI's framework iterators take ``reader_name=name``.

    Extras: ``order`` (an :class:`extsrc.Order`) gives each sample its record
    (``SampleInfo.record``, ``SampleInfo.rng``: shuffled, sharded) and ends
    each epoch after the shard's records, so that the callback needs no
    ``StopIteration``; ``last_batch="partial"`` hands a shorter last batch to
    DALI (``"drop"``, the default, drops it as DALI does; ``"pad"``, with an
    order, fills it from the start of the epoch's order); ``timeout``
    (seconds) bounds the wait for one batch and raises
    :class:`~extsrc.SourceTimeoutError`; ``in_place=True`` calls the source as
    ``source(sample_info, buffers)`` so that it can write each sample straight
    into shared memory (``buffers.array(shape, dtype)``): written once;
    ``stats_every`` (seconds) logs the source's statistics (see
    ``Pipeline.extsrc_stats()``) to the ``extsrc`` logger that often;
    ``concurrency=N`` keeps up to ``N`` samples in flight per worker (an
    ``async def`` source on the worker's event loop, a plain one on threads;
    see :class:`extsrc.ParallelSource`).

    Errors of the source (its exceptions, with their type and message, dead
    workers, invalid samples) are raised from the pipeline's ``run()``.
    Returns what DALI's ``external_source`` returns: a ``DataNode``, or a list
    of ``num_outputs`` of them.
    """
    if not parallel:
        if (last_batch != "drop" or timeout is not None or order is not None or in_place or stats_every
                or concurrency != 1):
            raise ValueError(
                "`last_batch`, `timeout`, `order`, `in_place`, `stats_every` and `concurrency` are extsrc options "
                "for parallel external sources; set parallel=True to use them"
            )
        # DALI's stub of external_source has no blocking= (the function takes it).
        return _dali_fn.external_source(  # type: ignore[call-overload, misc]
            source,
            num_outputs,
            cycle=cycle,
            name=name,
            device=device,
            layout=layout,
            dtype=dtype,
            ndim=ndim,
            cuda_stream=cuda_stream,
            use_copy_kernel=use_copy_kernel,
            blocking=blocking,
            batch=True if batch is None else batch,
            repeat_last=repeat_last,
            parallel=parallel,
            no_copy=no_copy,
            prefetch_queue_depth=prefetch_queue_depth,
            bytes_per_sample_hint=bytes_per_sample_hint,
            batch_info=batch_info,
            **kwargs,
        )

    caller = "extsrc.fn.external_source"
    # Argument checks, in the order and with the meaning DALI gives them.
    if source is None:
        raise ValueError(
            f"{caller} with parallel=True needs a `source`; feeding data with feed_input() is "
            "only possible without parallel=True"
        )
    if repeat_last:
        raise ValueError(
            f"{caller}: repeat_last=True is for sources fed with feed_input(), not for a source= callback"
        )
    if no_copy is not None and not no_copy:
        raise ValueError(
            f"{caller}: parallel sources are always fed without a copy; no_copy=False is not supported"
        )
    if prefetch_queue_depth is not None and (
        not isinstance(prefetch_queue_depth, int) or prefetch_queue_depth < 1
    ):
        raise ValueError(f"{caller}: prefetch_queue_depth must be a positive int, got {prefetch_queue_depth!r}")
    if bytes_per_sample_hint is not None and bytes_per_sample_hint < 1:
        raise ValueError(f"{caller}: bytes_per_sample_hint must be a positive int, got {bytes_per_sample_hint!r}")
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"`last_batch` must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")
    if num_outputs is not None and (not isinstance(num_outputs, int) or num_outputs < 1):
        raise ValueError(f"`num_outputs` must be a positive int, got {num_outputs!r}")
    mode = _cycle_mode(cycle)
    if batch is None:
        # DALI 2.4's fn.external_source defaults to batch=True, also with parallel=True. order= and
        # in_place=True (extsrc's own) work per sample only: with them the default is sample mode.
        batch = order is None and not in_place
    generator_like = _is_generator_function(source)
    if callable(source) and not generator_like:
        if mode != _CYCLE_OFF:
            raise ValueError(
                f"{caller}: cycle={cycle!r} applies to iterables and generator functions, and "
                "the source is a callable (it ends an epoch by raising StopIteration)"
            )
        if _positional_arg_count(source, 2 if in_place else 1) == 0:
            what = "a SampleInfo" if not batch else "the iteration number (or a BatchInfo with batch_info=True)"
            raise TypeError(
                f"{caller}, source {source!r}: Callable passed to External Source in parallel mode "
                f"(when `parallel=True`) must accept exactly one argument: here (batch={batch}) "
                f"{what}. Got a callable that does not accept arguments instead."
            )
        engine_source = source
    else:
        if not generator_like and not hasattr(source, "__iter__"):
            raise TypeError(
                f"`source` must be a callable, an iterable or a generator function, got "
                f"{type(source).__name__}"
            )
        if not batch:
            what = "a generator function" if generator_like else "an iterable"
            raise TypeError(
                f"Parallel external source with {what} must be run in a batch mode: {what} "
                "yields whole batches, so pass batch=True (sample mode, batch=False, needs a "
                "callable taking a SampleInfo)"
            )
        if inspect.isgenerator(source) and mode != _CYCLE_OFF:
            raise TypeError(
                f"{caller}: cycle={cycle!r} needs to restart the source, and a generator object "
                "cannot restart; pass the generator function itself as source"
            )
        if generator_like and not inspect.isgeneratorfunction(source):
            engine_source = _GeneratorCall(source)
        else:
            engine_source = source
    try:
        from nvidia.dali import _autograph

        converted = _autograph.is_autograph_artifact(source)
    except Exception:
        converted = False
    if converted:
        raise ValueError(
            "The `source` passed to a parallel external source was converted by AutoGraph "
            "(conditional execution); define it at global scope or mark its factory with "
            "`@nvidia.dali.pipeline.do_not_convert`."
        )

    callable_source = callable(source) and not generator_like
    pipe = _current_extsrc_pipeline(caller)
    if pipe._enable_checkpointing and not callable_source:
        warnings.warn(
            "Checkpointing enabled in a pipeline with a parallel external source whose source "
            "is an iterable or a generator function. DALI doesn't capture state of such "
            "'source' (nor does extsrc): its position cannot be saved, and after restoring a "
            "checkpoint it starts its epoch from the beginning.",
            Warning,
            stacklevel=2,
        )
    batch_size = pipe.max_batch_size
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"{caller} with parallel=True needs the pipeline's batch_size (a positive int), "
            f"got {batch_size!r}"
        )
    outputs = 1 if num_outputs is None else num_outputs
    engine_dtype, engine_ndim = _engine_dtypes_ndims(dtype, ndim, layout, outputs, num_outputs is not None)
    held = pipe._extsrc_batches_held()
    pool = pipe._extsrc_pool_for_new_source()
    parallel_source = ParallelSource(
        engine_source,
        batch_size,
        num_outputs=num_outputs,
        batch=bool(batch),
        batch_info=bool(batch_info) and bool(batch) and callable_source,
        prefetch=(prefetch_queue_depth if prefetch_queue_depth is not None
                  else max(default_prefetch(pipe.py_num_workers, pool.max_outstanding),
                           pipe._extsrc_depth())),
        last_batch=last_batch,
        order=order,
        in_place=in_place,
        stats_every=stats_every,
        concurrency=concurrency,
        dtype=engine_dtype,
        ndim=engine_ndim,
        timeout=timeout,
        batches_held=held,
        pool=pool,
        name=name if name is not None else _describe(source),
    )
    feeder = _Feeder(parallel_source, callable_source, mode, held, source, name)
    pipe._extsrc_feeders.append(feeder)
    return _dali_fn.external_source(  # type: ignore[call-overload, misc]  # blocking=, as above
        feeder,
        num_outputs,
        # DALI names only one-output sources (the name is for feed_input()); the extsrc source
        # keeps its name for reader_meta() either way.
        name=name if num_outputs is None else None,
        device=device,
        layout=layout,
        dtype=dtype,
        ndim=ndim,
        cuda_stream=cuda_stream,
        use_copy_kernel=use_copy_kernel,
        blocking=blocking,
        batch=True,
        batch_info=True,
        # Zero copy into a CPU operator; a GPU operator copies to the device anyway.
        no_copy=True if device == "cpu" else no_copy,
        **kwargs,
    )
