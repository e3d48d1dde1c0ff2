"""The DALI pipeline whose parallel external sources run on one extsrc worker pool."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional

from nvidia.dali import pipeline as _dali_pipeline

from extsrc.dali.pickling import DaliDefaultPickler
from extsrc.dali.reader_meta import source_reader_meta
from extsrc.dali.run_thread import RESET, RUN, RunThread
from extsrc.engine import (UNSET, ForkAfterCudaError, PoolClosedError, WorkerPool, check_backend,
                           close_when_collected, gpu_visible, no_gpu_message, non_negative_int)


# DALI's words for a fork after CUDA, first in extsrc's message, so that a search for DALI's
# message (DALI's own tests match it) finds extsrc's.
DALI_FORK_AFTER_CUDA = "Cannot fork a process when the CUDA has been initialized in the process."

# Arguments of extsrc's Pipeline that DALI's does not have.
EXTSRC_PIPELINE_ARGS = ("py_backend", "py_ray_options")


class Pipeline(_dali_pipeline.Pipeline):
    """``nvidia.dali.Pipeline`` whose ``parallel=True`` external sources run on extsrc workers.

    Takes every argument of DALI's ``Pipeline``. ``py_num_workers``,
    ``py_start_method`` (``"fork"``, ``"spawn"``, ``"forkserver"``) and
    ``py_callback_pickler`` configure one :class:`~extsrc.WorkerPool` that
    serves all parallel external sources of the pipeline; DALI's own worker
    pool is never created. ``py_backend="ray"`` makes its workers Ray actors
    anywhere in the cluster (with ``py_ray_options`` for them, see
    :class:`extsrc.ray.RayBackend`); ``py_start_method`` is then not given.
    ``py_worker_restarts`` (extsrc's; default 0, as DALI, whose lost worker
    fails the pipeline): how many lost workers are replaced, their batches
    redone, before a loss raises ``WorkerDiedError`` from ``run()``.

    Life cycle: definition (the graph function runs; each parallel source is
    registered with the pool), ``start_py_workers()`` (starts the workers;
    with ``fork`` call it before anything in the process uses CUDA),
    ``build()`` (starts the workers if needed, then builds DALI's backend),
    ``run()`` (raises ``StopIteration`` at the end of an epoch), ``reset()``
    (next epoch), ``close()`` (stops DALI's backend and the workers, frees the
    shared memory; idempotent). ``checkpoint()`` and the ``checkpoint=``
    argument work as in DALI and resume the parallel sources exactly where the
    checkpoint was taken (callable sources).

    ``with pipe:`` around the definition of a pipeline (legacy API, graph not
    yet defined) only makes it the current pipeline, as in DALI. ``with pipe:``
    on a defined pipeline (e.g. one made by :func:`pipeline_def`) also closes
    it on exit.
    """

    def __init__(
        self,
        *args: Any,
        py_num_workers: Optional[int] = 1,
        py_start_method: Optional[str] = UNSET,
        py_callback_pickler: Any = None,
        py_backend: str = "processes",
        py_ray_options: Optional[dict] = None,
        py_worker_restarts: int = 0,
        **kwargs: Any,
    ):
        # None and 0 are accepted, as DALI accepts them: only a parallel source needs workers.
        if py_num_workers is not None and (
            not isinstance(py_num_workers, int) or isinstance(py_num_workers, bool) or py_num_workers < 0
        ):
            raise ValueError(f"py_num_workers must be None or a non-negative int, got {py_num_workers!r}")
        py_backend, py_start_method, py_ray_options = check_backend(
            "py_backend", py_backend, py_start_method, py_ray_options,
            ("py_start_method", "py_ray_options"))
        if py_callback_pickler is not None and py_start_method == "fork":
            raise ValueError(
                "py_callback_pickler is used only by spawn and forkserver workers; with "
                "py_start_method='fork' the callbacks are inherited, not pickled"
            )
        self._extsrc_runner = RunThread("extsrc-dali-run")
        self._extsrc_closed = False  # for users: run() and the rest refuse once close() began
        self._extsrc_closed_fully = False  # close() ran to its end
        self._extsrc_pool: Optional[WorkerPool] = None
        self._extsrc_feeders: List[Any] = []
        self._extsrc_exits_close: List[bool] = []
        self._extsrc_num_workers = py_num_workers
        self._extsrc_start_method = py_start_method
        self._extsrc_pickler = py_callback_pickler
        self._extsrc_backend = py_backend
        self._extsrc_ray_options = py_ray_options
        self._extsrc_restarts = non_negative_int("py_worker_restarts", py_worker_restarts)
        # DALI keeps its defaults for py_*: it never sees a parallel source, so it starts no pool.
        super().__init__(*args, **kwargs)

    # -- what DALI reports ------------------------------------------------------

    @property
    def py_num_workers(self) -> Optional[int]:
        """Number of extsrc worker processes serving the parallel external sources (as given)."""
        return self._extsrc_num_workers

    @property
    def py_start_method(self) -> Optional[str]:
        """How the extsrc workers are started: ``"fork"``, ``"spawn"`` or ``"forkserver"``
        (``None`` with ``py_backend="ray"``)."""
        return self._extsrc_start_method

    @property
    def py_backend(self) -> str:
        """What the extsrc workers are: ``"processes"`` on this host, or ``"ray"`` actors."""
        return self._extsrc_backend

    @property
    def extsrc_pool(self) -> Optional[WorkerPool]:
        """The :class:`~extsrc.WorkerPool` of the parallel sources (``None`` while there is none)."""
        return self._extsrc_pool

    # -- parallel sources seen as readers by DALI's framework iterators ---------

    def _extsrc_named_sources(self) -> Dict[str, Any]:
        """The parallel sources given ``name=``, by name (the graph is defined first if needed)."""
        if not self._py_graph_built:
            self._build_graph()
        return {f.name: f.source for f in self._extsrc_feeders if f.name is not None}

    def reader_meta(self, name: Optional[str] = None) -> Dict[str, Any]:
        """DALI's reader metadata, also for parallel external sources with ``name=`` and ``order=``.

        ``reader_meta(name)`` of such a source describes its epoch as a
        reader's (``epoch_size``, ``epoch_size_padded``, ``number_of_shards``,
        ``shard_id``, ``pad_last_batch``, ``stick_to_shard``), so that
        ``DALIGenericIterator(pipe, ..., reader_name=name)`` knows the epoch's
        length and applies its ``last_batch_policy`` as with a DALI reader (see
        :mod:`extsrc.dali.reader_meta`). Raises ``ValueError`` for a source
        without an order or with ``last_batch="partial"``, saying what to use
        instead. Any other name is DALI's. Without a name: DALI's readers and
        the named parallel sources that have an order and full batches.
        """
        sources = self._extsrc_named_sources()
        if name is not None:
            if name in sources:
                return source_reader_meta(name, sources[name])
            return super().reader_meta(name)
        meta = super().reader_meta()
        for source_name, source in sources.items():
            if source.spec.order is not None and source.last_batch != "partial":
                meta[source_name] = source_reader_meta(source_name, source)
        return meta

    def epoch_size(self, name: Optional[str] = None) -> Any:
        """DALI's ``epoch_size``, also for named parallel sources with an order (see :meth:`reader_meta`)."""
        if name is not None:
            return self.reader_meta(name)["epoch_size_padded"]
        return {k: v["epoch_size_padded"] for k, v in self.reader_meta().items()}

    def external_source_shm_statistics(self) -> Dict[str, List[int]]:
        """DALI's report of the parallel external sources' shared memory, with extsrc's figures.

        ``capacities``: the bytes of each batch slot of every parallel source (a
        slot holds one whole batch: its dense region and the workers' overflow
        segments); ``per_sample_capacities``: each of those divided by the
        pipeline's batch size. Slots are made as batches are prepared, from the
        first one's size, so both lists are empty before the first ``run()``
        (DALI's start at a preset size); ``bytes_per_sample_hint`` does not
        change them. Empty without parallel sources and after ``close()``.
        """
        capacities: List[int] = []
        if not self._extsrc_closed:
            for feeder in self._extsrc_feeders:
                capacities.extend(feeder.source.shared_memory_capacities())
        batch_size = max(1, int(self.max_batch_size or 1))
        return {
            "capacities": capacities,
            "per_sample_capacities": [c // batch_size for c in capacities],
        }

    def extsrc_stats(self, reset: bool = False) -> Dict[str, Any]:
        """The statistics of each parallel external source, by name (see ``ParallelSource.stats``).

        ``str()`` of each is a short report ending in a diagnosis: is the input
        the bottleneck, and what to change. ``reset=True`` starts new windows.
        """
        return {feeder.source.name: feeder.source.stats(reset) for feeder in self._extsrc_feeders}

    def extsrc_faults(self) -> Dict[str, List[Any]]:
        """The samples each parallel external source failed on and skipped or replaced
        (``on_error=``), by name (see ``ParallelSource.faults``)."""
        return {feeder.source.name: feeder.source.faults() for feeder in self._extsrc_feeders}

    # -- what the parallel external sources ask of the pipeline -----------------

    def _extsrc_depth(self) -> int:
        """Batches DALI takes ahead of the one whose outputs run() returns."""
        if self.exec_separated:
            return max(self.cpu_queue_size, self.gpu_queue_size)
        return self.cpu_queue_size

    def _extsrc_batches_held(self) -> int:
        """How many fed batches the feeder keeps referenced for DALI.

        DALI takes a ``no_copy`` batch as a bare pointer: it holds no Python
        reference to the arrays, so the feeder must, for as long as DALI may
        read them; the engine then keeps their memory unchanged (it is reused
        only when no reference is left). Batch ``n`` is fed without a copy when DALI schedules iteration ``n``,
        ``depth`` iterations ahead of the run() that returns its outputs, and
        DALI reads it until that iteration has finished, which is before the
        next run() takes batch ``n + depth``. Outputs kept by the user never
        point at a batch for longer: the default (dynamic) executor copies the
        pipeline outputs into memory of its own, and the older executors, whose
        outputs may *be* the fed batch (an external source returned directly or
        through a reshape), make every output invalid at the next run(), which
        takes only batch ``n + depth``. One spare batch covers
        ``schedule_run()`` called before ``release_outputs()``. With separated
        queues DALI documents the buffer as free after ``cpu * gpu`` iterations.
        """
        if self.exec_separated:
            cpu, gpu = self.cpu_queue_size, self.gpu_queue_size
            return max(cpu * gpu, cpu + gpu) + 1
        return self._extsrc_depth() + 1

    def _extsrc_pool_for_new_source(self) -> WorkerPool:
        self._extsrc_check_open()
        if self._extsrc_num_workers is None or self._extsrc_num_workers < 1:
            # DALI's words first, so that a search for DALI's message finds this one.
            raise RuntimeError(
                "The external source cannot run in parallel mode without Python workers pool: "
                f"the pipeline has py_num_workers={self._extsrc_num_workers!r}. Pass "
                "py_num_workers=N (N >= 1) to the pipeline, or drop parallel=True"
            )
        if self._extsrc_pool is None:
            # DALI's default pickler refuses what extsrc's would carry by value: a function its
            # module does not hold under its name (extsrc.dali.pickling).
            pickler = DaliDefaultPickler if self._extsrc_pickler is None else self._extsrc_pickler
            if self._extsrc_backend == "ray":
                self._extsrc_pool = WorkerPool(self._extsrc_num_workers, pickler=pickler,
                                               backend="ray", ray_options=self._extsrc_ray_options,
                                               worker_restarts=self._extsrc_restarts)
            else:
                self._extsrc_pool = WorkerPool(self._extsrc_num_workers, self._extsrc_start_method, pickler,
                                               worker_restarts=self._extsrc_restarts)
        if self._extsrc_pool.started:
            raise RuntimeError(
                "a parallel external source cannot be added after the pipeline's workers "
                "started (start_py_workers()/build()); define every source first"
            )
        return self._extsrc_pool

    def _extsrc_check_open(self) -> None:
        if self._extsrc_closed:
            raise PoolClosedError("the pipeline was closed; create a new one to run it again")

    # -- life cycle -------------------------------------------------------------

    def start_py_workers(self) -> None:
        """Starts the extsrc workers of the parallel external sources (no-op if started).

        With ``py_start_method="fork"`` call it before anything in this
        process initialises CUDA (building a GPU pipeline, CuPy, PyTorch);
        ``build()`` calls it first. Raises
        :class:`~extsrc.errors.ForkAfterCudaError` (a ``RuntimeError``, DALI's
        sentence first) if ``fork`` is asked for after CUDA was initialised.
        """
        self._extsrc_check_open()
        if not self._py_graph_built:
            self._build_graph()
        if self._parallel_input_callbacks:
            raise TypeError(
                "this extsrc pipeline contains a parallel external source from "
                "nvidia.dali.fn.external_source; create it with extsrc.fn.external_source "
                "(from extsrc import fn) so that it runs on extsrc workers"
            )
        super().start_py_workers()
        if self._extsrc_pool is not None:
            try:
                self._extsrc_pool.start()
            except ForkAfterCudaError as exc:
                raise ForkAfterCudaError(f"{DALI_FORK_AFTER_CUDA} extsrc {exc}") from None
            for feeder in self._extsrc_feeders:  # their first batches are made from now on
                feeder.source.start()

    def build(self) -> None:
        """Starts the workers (see :meth:`start_py_workers`), then builds DALI's backend.

        Raises ``RuntimeError`` saying so when the pipeline asks for a GPU
        (``device_id`` not None) and none is usable here.
        """
        self._extsrc_check_open()
        try:
            super().build()
        except RuntimeError as exc:
            visible, why = gpu_visible()
            if self.device_id is None or (visible and "CUDA is not available" not in str(exc)):
                raise
            raise RuntimeError(no_gpu_message(
                f"this pipeline (device_id={self.device_id})",
                why or "CUDA is not available",
                "Build it with device_id=None and CPU operators (device='cpu' instead of "
                "'mixed' or 'gpu'), or run it where a GPU is visible.",
            )) from None

    def run(self, *args: Any, **pipeline_inputs: Any) -> Any:
        """DALI's ``run()``; an interrupt (Ctrl-C) during it loses and repeats no batch.

        DALI's ``run()`` runs on a thread of the pipeline's (see
        :mod:`extsrc.dali.run_thread`), so a ``KeyboardInterrupt`` reaches you
        at once while DALI's iteration goes on; the next ``run()`` returns its
        outputs (or raises what it raised, ``StopIteration`` at the end of the
        epoch) instead of running another iteration. Same arguments, outputs
        and exceptions as DALI's ``run()``.
        """
        self._extsrc_check_open()
        runner = self._extsrc_runner
        if runner.pending is not None and runner.pending.kind == RESET:
            runner.collect()  # an interrupted reset() finishes first
        if runner.pending is None:
            self.build()  # in this thread: workers start from it, as without the run thread
            runner.start(RUN, functools.partial(_dali_pipeline.Pipeline.run, self, *args, **pipeline_inputs))
        return runner.collect()

    def reset(self) -> None:
        """DALI's ``reset()`` (next epoch after ``StopIteration``), on the run thread like
        :meth:`run`: an interrupt during it leaves it to finish; calling it again then only
        waits for it. An epoch end that an interrupted ``run()`` did not hand over is the one
        this reset answers."""
        runner = self._extsrc_runner
        pending = runner.pending
        if pending is not None and pending.kind == RESET:
            return runner.collect()
        if pending is not None:
            runner.wait()
            if not isinstance(pending.error, StopIteration):
                # Outputs of an interrupted run() wait for the next run(); DALI's reset() does
                # nothing before the epoch's end.
                return super().reset()
            runner.drop()
        runner.start(RESET, functools.partial(_dali_pipeline.Pipeline.reset, self))
        return runner.collect()

    def _extsrc_settle(self) -> None:
        """Waits for an interrupted run()/reset() still running, so DALI is used by one thread."""
        self._extsrc_runner.wait()

    def schedule_run(self) -> None:
        self._extsrc_settle()
        super().schedule_run()

    def outputs(self, *args: Any, **kwargs: Any) -> Any:
        self._extsrc_settle()
        return super().outputs(*args, **kwargs)

    def share_outputs(self, *args: Any, **kwargs: Any) -> Any:
        self._extsrc_settle()
        return super().share_outputs(*args, **kwargs)

    def release_outputs(self) -> None:
        self._extsrc_settle()
        super().release_outputs()

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        self._extsrc_settle()
        return super().checkpoint(*args, **kwargs)

    def close(self) -> None:
        """Stops DALI's backend and the workers and frees the shared memory. Idempotent.

        Outputs already returned by ``run()`` stay readable (the default
        executor gives you copies). The pipeline cannot run again.
        """
        if getattr(self, "_extsrc_closed_fully", True):  # True too if __init__ did not get there
            return
        # A close() interrupted (KeyboardInterrupt) after this point is finished by the next call
        # (close_when_collected makes it from __del__): each step below may be repeated.
        self._extsrc_closed = True
        self._extsrc_runner.stop()  # after a run() an interrupt left running
        self._extsrc_runner.drop()
        # DALI first, so nothing reads a batch while the workers go away.
        self._shutdown()
        for feeder in self._extsrc_feeders:
            feeder.release()
        if self._extsrc_pool is not None:
            self._extsrc_pool.close()
        self._extsrc_closed_fully = True

    def __enter__(self) -> "Pipeline":
        defined = (
            self._graph_out is not None
            or self._py_graph_built
            or type(self).define_graph is not _dali_pipeline.Pipeline.define_graph
        )
        self._extsrc_exits_close.append(defined)
        return super().__enter__()

    def __exit__(self, exception_type, exception_value, traceback) -> None:
        super().__exit__(exception_type, exception_value, traceback)
        if self._extsrc_exits_close.pop():
            self.close()

    def __del__(self, _collected=close_when_collected):  # bound here: at exit names may be None
        _collected(self.close)
        try:
            super().__del__()
        except Exception:
            pass


def pipeline_def(
    fn: Optional[Callable[..., Any]] = None, *, enable_conditionals: bool = False, **pipeline_kwargs: Any
):
    """``nvidia.dali.pipeline_def`` making an :class:`extsrc.dali.Pipeline`.

    Same use as DALI's: ``@pipeline_def`` or ``@pipeline_def(batch_size=...,
    ...)``; every keyword of DALI's ``Pipeline`` can be given to the decorator
    or when calling the decorated function (the call wins), e.g.
    ``my_pipe(batch_size=8, device_id=None, py_num_workers=2)``; the other
    call arguments go to the graph function. ``py_num_workers``,
    ``py_start_method``, ``py_callback_pickler``, ``py_backend`` and
    ``py_ray_options`` configure the extsrc workers that run the
    ``parallel=True`` external sources.
    """

    def decorate(func: Callable[..., Any]) -> Callable[..., Pipeline]:
        if _dali_pipeline._conditionals._autograph.is_autograph_artifact(func):
            raise ValueError(
                f"pipeline_def: {func.__qualname__} is marked with @do_not_convert, which is for "
                "functions called inside a pipeline, not for the pipeline definition itself"
            )

        signature = inspect.getfullargspec(func)
        own_params = set(signature.args) | set(signature.kwonlyargs)

        @functools.wraps(func)
        def create_pipeline(*args: Any, **kwargs: Any) -> Pipeline:
            conditionals = kwargs.get("enable_conditionals", enable_conditionals)
            graph_func = _dali_pipeline._preprocess_pipe_func(func, conditionals)
            # DALI's Pipeline does not know extsrc's own arguments: they go to ours directly.
            own = {k: kwargs.pop(k) for k in EXTSRC_PIPELINE_ARGS if k in kwargs and k not in own_params}
            ctor_kwargs, func_kwargs = _dali_pipeline._regroup_args(func, pipeline_kwargs, kwargs)
            ctor_kwargs.update(own)
            pipe = Pipeline(**ctor_kwargs)
            try:
                _dali_pipeline._preprocess_pipe_object(pipe, conditionals, args, func_kwargs)
                _dali_pipeline._generate_graph(pipe, graph_func, args, func_kwargs)
            except BaseException:
                pipe.close()  # sources defined so far hold shared memory
                raise
            return pipe

        create_pipeline._is_pipeline_def = True  # type: ignore[attr-defined]  # how DALI marks one
        return create_pipeline

    return decorate(fn) if fn is not None else decorate
