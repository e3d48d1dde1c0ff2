"""``external_source`` for DALI pipelines, with ``parallel=True`` served by the extsrc engine.

Without ``parallel=True`` the call is DALI's, untouched. With it, the steps
(each a function below) are:

1. :func:`_check_dali_only_arguments`: what DALI takes and the engine never
   sees (``repeat_last``, ``no_copy``, ``prefetch_queue_depth``,
   ``bytes_per_sample_hint``), with DALI's meaning;
2. :func:`engine_source`: the kind of source as DALI tells it (callable,
   iterable, generator function), checked with DALI's words, and what the
   engine runs for it;
3. :func:`_pipeline_for_parallel_source`: the current pipeline, which must be
   an :class:`extsrc.dali.Pipeline`, and DALI's warnings for it;
4. :func:`_parallel_source`: the :class:`~extsrc.ParallelSource` on the
   pipeline's one worker pool; the engine checks every argument it takes;
5. :func:`_dali_node`: DALI's ordinary batch external source whose callback is
   the :class:`~extsrc.dali.feeder.Feeder` of that source.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Optional, Tuple, Union

import nvidia.dali.fn as _dali_fn
from nvidia.dali.pipeline import Pipeline as _DaliPipeline

from extsrc.dali.arguments import (GeneratorCall, describe, engine_dtypes_ndims, is_generator_function,
                                   positional_arg_count)
from extsrc.dali.feeder import CALLER as _CALLER
from extsrc.dali.feeder import CYCLE_OFF, Feeder, cycle_mode
from extsrc.engine import Hooks, ParallelSource, default_prefetch, positive_int

# extsrc's own arguments, for parallel sources only.
_EXTSRC_ONLY = ("last_batch", "timeout", "order", "in_place", "stats_every", "concurrency",
                "on_error", "max_errors")


def _kept_from_autograph() -> None:
    """extsrc's code, like DALI's own, is not converted by AutoGraph when a pipeline with
    ``enable_conditionals=True`` calls it (converted, the drop-in's own checks ran as graph
    code, and its errors read as the user's). AutoGraph has no public way to say so: its rules
    are DALI's private module's (``nvidia.dali._autograph``), left alone where it has none."""
    try:
        from nvidia.dali._autograph.core import config
    except ImportError:
        return
    rules: Tuple[Any, ...] = config.CONVERSION_RULES
    if not any(str(rule) == "DoNotConvert rule for extsrc" for rule in rules):
        config.CONVERSION_RULES = (config.DoNotConvert("extsrc"),) + rules


_kept_from_autograph()


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
    order: Any = None,
    in_place: bool = False,
    stats_every: Optional[float] = None,
    concurrency: int = 1,
    on_error: Any = "raise",
    max_errors: Union[None, int, float] = None,
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
    see :class:`extsrc.ParallelSource`); ``on_error`` (``"raise"``, ``"skip"``
    or a callable ``(info, error) -> sample``) and ``max_errors`` say what a
    sample the source fails on does (see :class:`extsrc.ParallelSource`).

    Errors of the source (its exceptions, with their type and message, dead
    workers, invalid samples) are raised from the pipeline's ``run()``.
    Returns what DALI's ``external_source`` returns: a ``DataNode``, or a list
    of ``num_outputs`` of them.
    """
    if not parallel:
        _refuse_extsrc_options(last_batch=last_batch, timeout=timeout, order=order, in_place=in_place,
                               stats_every=stats_every, concurrency=concurrency,
                               on_error=on_error, max_errors=max_errors)
        # DALI's stub of external_source has no blocking= (the function takes it).
        return _dali_fn.external_source(  # type: ignore[call-overload, misc]
            source, num_outputs, cycle=cycle, name=name, device=device, layout=layout, dtype=dtype,
            ndim=ndim, cuda_stream=cuda_stream, use_copy_kernel=use_copy_kernel, blocking=blocking,
            batch=True if batch is None else batch, repeat_last=repeat_last, parallel=parallel,
            no_copy=no_copy, prefetch_queue_depth=prefetch_queue_depth,
            bytes_per_sample_hint=bytes_per_sample_hint, batch_info=batch_info, **kwargs,
        )
    _check_dali_only_arguments(source, repeat_last, no_copy, prefetch_queue_depth, bytes_per_sample_hint)
    mode = cycle_mode(cycle)
    if batch is None:
        # DALI 2.4's fn.external_source defaults to batch=True, also with parallel=True. order= and
        # in_place=True (extsrc's own) work per sample only: with them the default is sample mode.
        batch = order is None and not in_place
    engine_src, callable_source = engine_source(source, bool(batch), cycle, mode, in_place)
    pipe = _pipeline_for_parallel_source(callable_source)
    engine_dtype, engine_ndim = engine_dtypes_ndims(dtype, ndim, layout, num_outputs)
    parallel_source = _parallel_source(
        pipe, engine_src, num_outputs=num_outputs, batch=bool(batch),
        batch_info=bool(batch_info) and bool(batch) and callable_source,
        prefetch=prefetch_queue_depth, last_batch=last_batch, order=order, in_place=in_place,
        stats=_stats(stats_every), concurrency=concurrency, on_error=on_error,
        max_errors=max_errors, dtype=engine_dtype, ndim=engine_ndim, timeout=timeout,
        name=name if name is not None else describe(source),
    )
    feeder = Feeder(parallel_source, callable_source, mode, pipe._extsrc_batches_held(), source, name)
    pipe._extsrc_feeders.append(feeder)
    return _dali_node(feeder, num_outputs, name=name, device=device, layout=layout, dtype=dtype, ndim=ndim,
                      cuda_stream=cuda_stream, use_copy_kernel=use_copy_kernel, blocking=blocking,
                      no_copy=no_copy, **kwargs)


def _stats(stats_every: Any) -> Any:
    """The engine's ``stats=`` for the drop-in's ``stats_every=`` (seconds between reports)."""
    if stats_every is None:
        return True
    if isinstance(stats_every, bool) or not isinstance(stats_every, (int, float)) or not stats_every > 0:
        raise ValueError(f"stats_every must be None or a positive number of seconds, got {stats_every!r}")
    return stats_every


def _refuse_extsrc_options(**given: Any) -> None:
    """extsrc's own arguments are for parallel sources: refused at their defaults' opposite."""
    defaults = {"last_batch": "drop", "timeout": None, "order": None, "in_place": False,
                "stats_every": None, "concurrency": 1, "on_error": "raise", "max_errors": None}
    used = [k for k in _EXTSRC_ONLY if given[k] != defaults[k]]
    if used:
        raise ValueError(
            f"{', '.join(f'`{k}`' for k in used)}: `last_batch`, `timeout`, `order`, `in_place`, "
            "`stats_every`, `concurrency`, `on_error` and `max_errors` are extsrc options for parallel external sources; "
            "set parallel=True to use them"
        )


def _check_dali_only_arguments(source: Any, repeat_last: bool, no_copy: Optional[bool],
                               prefetch_queue_depth: Optional[int],
                               bytes_per_sample_hint: Optional[int]) -> None:
    """DALI's arguments that the engine never sees, checked with DALI's meaning."""
    if source is None:
        raise ValueError(
            f"{_CALLER} with parallel=True needs a `source`; feeding data with feed_input() is "
            "only possible without parallel=True"
        )
    if repeat_last:
        raise ValueError(
            f"{_CALLER}: repeat_last=True is for sources fed with feed_input(), not for a source= callback"
        )
    if no_copy is not None and not no_copy:
        raise ValueError(
            f"{_CALLER}: parallel sources are always fed without a copy; no_copy=False is not supported"
        )
    # The engine checks its `prefetch`; this names the argument the user gave.
    if prefetch_queue_depth is not None:
        positive_int(f"{_CALLER}: prefetch_queue_depth", prefetch_queue_depth)
    if bytes_per_sample_hint is not None:
        positive_int(f"{_CALLER}: bytes_per_sample_hint", bytes_per_sample_hint)


def engine_source(source: Any, batch: bool, cycle: Any, mode: str, in_place: bool,
                  caller: str = _CALLER) -> Tuple[Any, bool]:
    """``(what the engine runs, whether it is a callable source)`` for DALI's ``source``.

    A callable (not a generator function) follows DALI's numbers and takes
    exactly one argument; an iterable or a generator function yields whole
    batches (batch mode) and may cycle. Anything else is left to the engine,
    which refuses it saying what it accepts.
    """
    generator_like = is_generator_function(source)
    if callable(source) and not generator_like:
        if mode != CYCLE_OFF:
            raise ValueError(
                f"{caller}: cycle={cycle!r} applies to iterables and generator functions, and "
                "the source is a callable (it ends an epoch by raising StopIteration)"
            )
        if positional_arg_count(source, 2 if in_place else 1) == 0:
            what = "a SampleInfo" if not batch else "the iteration number (or a BatchInfo with batch_info=True)"
            raise TypeError(
                f"{caller}, source {source!r}: Callable passed to External Source in parallel mode "
                f"(when `parallel=True`) must accept exactly one argument: here (batch={batch}) "
                f"{what}. Got a callable that does not accept arguments instead."
            )
        _refuse_autograph(source, caller)
        return source, True
    if generator_like or hasattr(source, "__iter__"):
        if not batch:
            what = "a generator function" if generator_like else "an iterable"
            raise TypeError(
                f"Parallel external source with {what} must be run in a batch mode: {what} "
                "yields whole batches, so pass batch=True (sample mode, batch=False, needs a "
                "callable taking a SampleInfo)"
            )
        if inspect.isgenerator(source) and mode != CYCLE_OFF:
            raise TypeError(
                f"{caller}: cycle={cycle!r} needs to restart the source, and a generator object "
                "cannot restart; pass the generator function itself as source"
            )
        _refuse_autograph(source, caller)
        if generator_like and not inspect.isgeneratorfunction(source):
            return GeneratorCall(source), False  # the engine calls plain generator functions itself
    return source, False


def _refuse_autograph(source: Any, caller: str) -> None:
    """A source converted by AutoGraph (conditionals) cannot run in a worker."""
    try:
        from nvidia.dali import _autograph

        converted = _autograph.is_autograph_artifact(source)
    except Exception:
        converted = False
    if converted:
        raise ValueError(
            f"{caller}: the `source` ({describe(source)}) was converted by AutoGraph, as "
            "everything defined inside a pipeline with enable_conditionals=True is, and a "
            "converted function cannot run in a worker process. To allow the `source` to be "
            "correctly used in the workers, it must remain unconverted: define it at global "
            "scope, or mark it (or the function that makes it) with "
            "`@nvidia.dali.pipeline.do_not_convert`."
        )


def _pipeline_for_parallel_source(callable_source: bool):
    """The current pipeline (an :class:`extsrc.dali.Pipeline`), with DALI's checkpoint warning."""
    from extsrc.dali.pipeline import Pipeline

    pipe = _DaliPipeline.current()
    if pipe is None:
        _DaliPipeline._raise_pipeline_required(_CALLER)
    if not isinstance(pipe, Pipeline):
        raise TypeError(
            f"{_CALLER} with parallel=True runs on extsrc workers and needs a pipeline created "
            "by extsrc.pipeline_def (or extsrc.dali.Pipeline); the current pipeline is a "
            f"{type(pipe).__module__}.{type(pipe).__name__}. Change "
            "`from nvidia.dali import pipeline_def` to `from extsrc import pipeline_def`."
        )
    if pipe._enable_checkpointing and not callable_source:
        warnings.warn(
            "Checkpointing enabled in a pipeline with a parallel external source whose source "
            "is an iterable or a generator function. DALI doesn't capture state of such "
            "'source' (nor does extsrc): its position cannot be saved, and after restoring a "
            "checkpoint it starts its epoch from the beginning.",
            Warning,
            stacklevel=3,
        )
    return pipe


def _parallel_source(pipe: Any, source: Any, *, prefetch: Optional[int], batch_info: bool,
                     **options: Any) -> ParallelSource:
    """The engine's source on the pipeline's pool: the pipeline's batch size, ``prefetch`` batches
    ahead (default: two per worker, at least DALI's queue depth), memory kept for the batches
    the feeder holds for DALI, dense outputs as one array (what DALI is fed), a ``BatchInfo``
    for a batch callable with ``batch_info``."""
    batch_size = pipe.max_batch_size
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"{_CALLER} with parallel=True needs the pipeline's batch_size (a positive int), "
            f"got {batch_size!r}"
        )
    pool = pipe._extsrc_pool_for_new_source()
    if prefetch is None:
        concurrency = options.get("concurrency", 1)  # checked by the engine
        engine_default = default_prefetch(pool.num_workers, pool.max_outstanding,
                                          concurrency if isinstance(concurrency, int) else 1)
        # The engine's own default where it covers DALI's queue: it then goes further ahead for
        # small batches, which a prefetch given in numbers would forbid.
        prefetch = None if engine_default >= pipe._extsrc_depth() else pipe._extsrc_depth()
    return ParallelSource(source, batch_size, prefetch=prefetch,
                          batches_held=pipe._extsrc_batches_held(), pool=pool,
                          hooks=Hooks(batch_info=batch_info, dense_arrays=True), **options)


def _dali_node(feeder: Feeder, num_outputs: Optional[int], *, name: Optional[str], device: str,
               no_copy: Optional[bool], **dali_args: Any) -> Any:
    """DALI's batch external source fed by ``feeder`` (``BatchInfo`` calls, no copy on the CPU)."""
    return _dali_fn.external_source(
        feeder,
        num_outputs,  # type: ignore[arg-type]  # None: one output, as DALI's function takes it
        # DALI names only one-output sources (the name is for feed_input()); the extsrc source
        # keeps its name for reader_meta() either way.
        name=name if num_outputs is None else None,
        device=device,
        batch=True,
        batch_info=True,
        # Zero copy into a CPU operator; a GPU operator copies to the device anyway.
        no_copy=True if device == "cpu" else no_copy,
        **dali_args,
    )
