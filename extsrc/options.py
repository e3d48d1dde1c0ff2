"""The options of a pool and of a source, checked once, in one place.

:class:`PoolOptions` and :class:`SourceOptions` are frozen records built by
their ``create`` class methods, which raise ``ValueError``/``TypeError``
saying which argument is wrong, what was expected and what came. Everything
downstream trusts them. A ``bool`` is never accepted where a number is
expected (``num_workers=True`` is an error, not 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Tuple, Union

import numpy as np

from extsrc.checks import is_int, is_number
from extsrc.order import Order

if TYPE_CHECKING:
    from extsrc.engine.pickling import Pickler  # for the annotation; create() imports it on use

START_METHODS = ("fork", "spawn", "forkserver")
LAST_BATCH_POLICIES = ("drop", "partial", "pad")
class _Unset:
    """Marks an argument the caller did not give (so that an explicit default is told apart)."""

    _instance: Optional["_Unset"] = None

    def __new__(cls) -> "_Unset":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<unset>"

    def __reduce__(self):
        return (_Unset, ())


UNSET: Any = _Unset()


def positive_int(name: str, value: Any) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def non_negative_number(name: str, value: Any) -> float:
    if not is_number(value) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return value


def check_backend(name: str, value: Any, start_method: Any = UNSET, options: Any = None,
                  names: Tuple[str, str] = ("start_method", "ray_options"),
                  ) -> Tuple[str, Optional[str], Optional[dict]]:
    """``(backend, start_method, backend options)`` checked: ``value`` must name a backend
    (see :mod:`extsrc.engine.backend`, whose module is imported now), which checks the other
    two (``names``: what they are called where they were given)."""
    from extsrc.engine.backend import backend_class

    if not isinstance(value, str):
        from extsrc.engine.backend import backend_names

        raise ValueError(f"{name} must be one of {backend_names()}, got {value!r}")
    checked_method, checked_options = backend_class(value, name).check_options(
        start_method, options, (name, *names), UNSET)
    return value, checked_method, checked_options


# num_outputs=AUTO_OUTPUTS: each sample is a tuple of arrays, as many as the source's first
# sample has (learnt in the workers, so the consumer need not run the callback to know it).
AUTO_OUTPUTS = "auto"


def optional_positive_int(name: str, value: Any) -> Optional[int]:
    return None if value is None else positive_int(name, value)


def per_output(name: str, value: Any, count: int) -> tuple:
    """One value per output: a list/tuple must have ``count`` entries; anything else repeats."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} outputs: {value!r}")
        return tuple(value)
    return (value,) * count


def _dtype(value: Any, output: int) -> Optional[np.dtype]:
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError as exc:
        raise TypeError(f"dtype of output {output}: expected a NumPy dtype, got {value!r} ({exc})") from None
    if dtype.kind not in "biufc":
        raise TypeError(f"dtype of output {output}: expected a numeric or bool dtype, got {dtype}")
    return dtype


def _ndim(value: Any, output: int) -> Optional[int]:
    if value is None:
        return None
    if not is_int(value) or value < 0:
        raise ValueError(f"ndim of output {output}: expected None or an int >= 0, got {value!r}")
    return int(value)


# With samples in flight together (concurrency > 1), the default prefetch is this many times
# larger: a batch is finished only when its slowest request is, and batches waiting for their
# last samples would otherwise take every place ahead while the workers' free places for
# requests stay empty (measured: 100 KiB objects with 20 ms to first byte, batch 64,
# 2 workers, concurrency=64: about 10% more samples/s with twice the batches ahead).
CONCURRENT_PREFETCH_FACTOR = 2


def default_prefetch(num_workers: int, tasks_per_worker: int = 2, concurrency: int = 1) -> int:
    """Batches produced ahead by default: as many per worker as a worker holds tasks (two for
    worker processes, as PyTorch's ``DataLoader``), so that each batch can be one task and
    every worker still has a task queued; :data:`CONCURRENT_PREFETCH_FACTOR` times that for
    samples in flight together (``concurrency > 1``)."""
    return tasks_per_worker * num_workers * (CONCURRENT_PREFETCH_FACTOR if concurrency > 1 else 1)


@dataclass(frozen=True)
class PoolOptions:
    """How a :class:`~extsrc.WorkerPool` runs its workers.

    ``backend="processes"``: worker processes on this host, started with
    ``start_method``. ``backend="ray"``: Ray actors anywhere in the cluster,
    created with ``ray_options`` (checked by the Ray backend,
    :mod:`extsrc.ray.options`, kept here as ``backend_options``);
    ``start_method`` is then ``None``.
    """

    num_workers: int
    start_method: Optional[str]
    pickler: Pickler
    backend: str = "processes"
    backend_options: Optional[dict] = None

    @classmethod
    def create(cls, num_workers: Any = 1, start_method: Any = UNSET, pickler: Any = None,
               backend: Any = "processes", ray_options: Any = None) -> "PoolOptions":
        from extsrc.engine.pickling import Pickler

        backend, start_method, options = check_backend("backend", backend, start_method, ray_options)
        return cls(positive_int("num_workers", num_workers), start_method, Pickler(pickler), backend,
                   options)


@dataclass(frozen=True)
class SourceOptions:
    """What a :class:`~extsrc.ParallelSource` produces and how far ahead."""

    batch_size: int
    num_outputs: Union[None, int, str]  # None, a count, or AUTO_OUTPUTS
    batch: bool
    batch_info: bool
    prefetch: int
    last_batch: str
    dtypes: Tuple[Optional[np.dtype], ...]
    ndims: Tuple[Optional[int], ...]
    timeout: Optional[float]
    batches_held: int
    order: Any = None  # an extsrc.Order, or None
    in_place: bool = False  # the callback gets a second argument to write samples into
    stats: bool = True  # collect the figures of ParallelSource.stats()
    stats_every: Optional[float] = None  # log them every this many seconds
    concurrency: int = 1  # samples in flight at once per worker (extsrc.engine.concurrent)
    round_robin: bool = False  # batch i made whole by worker i % num_workers (DataLoader's)
    dense_arrays: bool = False  # a dense output comes as one array rather than a Batch
    in_order: bool = True  # False: a finished batch may be handed out before earlier ones
    prefetch_auto: bool = False  # prefetch was not given: more batches go ahead when they are small

    @property
    def batches_per_epoch(self) -> Optional[int]:
        """With an order: how many batches an epoch has (``len(source)``); else None."""
        if self.order is None:
            return None
        records = len(self.order)
        if self.last_batch == "drop":
            return records // self.batch_size
        return -(-records // self.batch_size)

    @property
    def outputs(self) -> int:
        """How many outputs a sample has (1 when ``num_outputs`` is None; 0 while not known,
        with ``num_outputs=AUTO_OUTPUTS``)."""
        if isinstance(self.num_outputs, str):  # AUTO_OUTPUTS
            return 0
        return 1 if self.num_outputs is None else self.num_outputs

    @classmethod
    def create(
        cls,
        batch_size: Any,
        *,
        num_outputs: Any = None,
        batch: Any = False,
        batch_info: Any = False,
        prefetch: Any = None,
        num_workers: int = 1,
        tasks_per_worker: int = 2,
        last_batch: Any = "drop",
        dtype: Any = None,
        ndim: Any = None,
        timeout: Any = None,
        batches_held: Any = 2,
        order: Any = None,
        in_place: Any = False,
        stats: Any = True,
        stats_every: Any = None,
        concurrency: Any = 1,
        round_robin: Any = False,
        dense_arrays: Any = False,
        in_order: Any = True,
    ) -> "SourceOptions":
        batch_size = positive_int("batch_size", batch_size)
        if num_outputs == AUTO_OUTPUTS:
            if dtype is not None or ndim is not None:
                raise ValueError(f"dtype= and ndim= need a known num_outputs, not {AUTO_OUTPUTS!r}")
            if in_place:
                raise ValueError(f"in_place=True needs a known num_outputs, not {AUTO_OUTPUTS!r}")
        else:
            num_outputs = optional_positive_int("num_outputs", num_outputs)
        for name, value in (("batch", batch), ("batch_info", batch_info), ("in_place", in_place),
                            ("stats", stats), ("round_robin", round_robin),
                            ("dense_arrays", dense_arrays), ("in_order", in_order)):
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if batch_info and not batch:
            raise ValueError("batch_info=True needs batch=True (it is what a batch callback is given)")
        if last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")
        if order is not None:
            if not isinstance(order, Order):
                raise TypeError(f"order must be an extsrc.Order, got {type(order).__name__}")
            if batch:
                raise ValueError("order= gives each sample its record: it needs sample mode (batch=False)")
        if stats_every is not None and (
            not is_number(stats_every) or not stats_every > 0
        ):
            raise ValueError(f"stats_every must be None or a positive number of seconds, got {stats_every!r}")
        if stats_every is not None and not stats:
            raise ValueError("stats_every logs the statistics, which stats=False turns off")
        if in_place and batch:
            raise ValueError("in_place=True hands a sample-mode callback room for each sample; it "
                             "needs batch=False")
        if last_batch == "pad" and order is None:
            raise ValueError(
                "last_batch='pad' fills the last batch with records from the start of the epoch's "
                "order, so it needs order= (an extsrc.Order)"
            )
        concurrency = positive_int("concurrency", concurrency)
        if concurrency > 1 and batch:
            raise ValueError(
                f"concurrency={concurrency} keeps several samples in flight per worker: it needs "
                "sample mode (batch=False). A batch callback makes the whole batch: let it gather "
                "its requests itself (an async def callback runs on the worker's event loop)"
            )
        if concurrency > 1 and in_place:
            raise ValueError(f"in_place=True hands the callback room for one sample at a time; it "
                             f"cannot be combined with concurrency={concurrency}")
        if timeout is not None and (
            not is_number(timeout) or not timeout > 0
        ):
            raise ValueError(f"timeout must be None or a positive number of seconds, got {timeout!r}")
        outputs = 1 if num_outputs is None else 0 if num_outputs == AUTO_OUTPUTS else num_outputs
        dtypes = tuple(_dtype(d, j) for j, d in enumerate(per_output("dtype", dtype, outputs)))
        ndims = tuple(_ndim(n, j) for j, n in enumerate(per_output("ndim", ndim, outputs)))
        return cls(
            batch_size=batch_size,
            num_outputs=num_outputs,
            batch=bool(batch),
            batch_info=bool(batch_info),
            prefetch=(default_prefetch(num_workers, tasks_per_worker, concurrency) if prefetch is None
                      else positive_int("prefetch", prefetch)),
            last_batch=last_batch,
            dtypes=dtypes,
            ndims=ndims,
            timeout=timeout,
            batches_held=positive_int("batches_held", batches_held),
            order=order,
            in_place=bool(in_place),
            stats=bool(stats),
            stats_every=stats_every,
            concurrency=concurrency,
            round_robin=bool(round_robin),
            dense_arrays=bool(dense_arrays),
            in_order=bool(in_order),
            prefetch_auto=prefetch is None,
        )
