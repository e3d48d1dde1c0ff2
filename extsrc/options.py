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
BACKENDS = ("processes", "ray")
# Ray actor options a pool passes on (ray_options=...): where its actors run and what they hold.
RAY_OPTION_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type",
                   "label_selector", "scheduling_strategy", "runtime_env")
RAY_STRATEGIES = ("DEFAULT", "SPREAD")  # Ray's scheduling strategies given by name
# Actor options the pool sets itself, and why a user's value would break its contract.
RAY_OPTIONS_OWNED = {
    "max_restarts": "a restarted actor would have lost its source's state; a dead actor is an error",
    "max_task_retries": "a retried task would call the callback twice; a dead actor is an error",
    "max_concurrency": "a worker runs its tasks one at a time, in the order sent",
    "concurrency_groups": "a worker runs its tasks one at a time, in the order sent",
    "allow_out_of_order_execution": "a worker runs its tasks one at a time, in the order sent",
    "max_pending_calls": "the pool decides how many tasks each actor holds",
    "name": "the pool's actors are its own and die with close()",
    "namespace": "the pool's actors are its own and die with close()",
    "get_if_exists": "the pool's actors are its own and die with close()",
    "lifetime": "the pool's actors are its own and die with close()",
}


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


def check_backend(name: str, value: Any) -> str:
    """``value`` if it names a backend (``"processes"``, ``"ray"``), else ``ValueError``."""
    if not isinstance(value, str) or value not in BACKENDS:
        raise ValueError(f"{name} must be one of {BACKENDS}, got {value!r}")
    return value


def check_ray_options(name: str, value: Any) -> Optional[dict]:
    """A copy of ``value``, Ray actor options for a pool's actors; ``None`` stays ``None``.

    Keys must be among :data:`RAY_OPTION_KEYS`; numbers and resources are
    checked here, the rest (``scheduling_strategy``, ``runtime_env``,
    ``label_selector``) by Ray when the pool is created.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict of Ray actor options or None, got {type(value).__name__} "
                        f"{value!r}")
    for key, option in value.items():
        where = f"{name}[{key!r}]"
        if key in RAY_OPTIONS_OWNED:
            raise ValueError(f"{where}: extsrc sets this Ray option itself ({RAY_OPTIONS_OWNED[key]})")
        if key not in RAY_OPTION_KEYS:
            raise ValueError(f"{where}: not an option extsrc passes to its Ray actors; expected one of "
                             f"{RAY_OPTION_KEYS}")
        if key in ("num_cpus", "num_gpus", "memory"):
            non_negative_number(where, option)
        elif key == "resources":
            if not isinstance(option, dict):
                raise TypeError(f"{where} must be a dict of resource name to amount, got {option!r}")
            for resource, amount in option.items():
                if not isinstance(resource, str):
                    raise TypeError(f"{where}: resource names are str, got {resource!r}")
                non_negative_number(f"{where}[{resource!r}]", amount)
        elif key in ("runtime_env", "label_selector") and not isinstance(option, dict):
            raise TypeError(f"{where} must be a dict, got {type(option).__name__} {option!r}")
        elif key == "accelerator_type" and not isinstance(option, str):
            raise TypeError(f"{where} must be a str, got {option!r}")
        elif key == "scheduling_strategy" and isinstance(option, str) and option not in RAY_STRATEGIES:
            raise ValueError(f"{where} must be one of {RAY_STRATEGIES} or a Ray scheduling strategy "
                             f"object, got {option!r}")
    return dict(value)


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


def default_prefetch(num_workers: int, tasks_per_worker: int = 2) -> int:
    """Batches produced ahead by default: as many per worker as a worker holds tasks (two for
    worker processes, as PyTorch's ``DataLoader``), so that each batch can be one task and
    every worker still has a task queued."""
    return tasks_per_worker * num_workers


@dataclass(frozen=True)
class PoolOptions:
    """How a :class:`~extsrc.WorkerPool` runs its workers.

    ``backend="processes"``: worker processes on this host, started with
    ``start_method``. ``backend="ray"``: Ray actors anywhere in the cluster,
    created with ``ray_options``; ``start_method`` is then ``None``.
    """

    num_workers: int
    start_method: Optional[str]
    pickler: Pickler
    backend: str = "processes"
    ray_options: Optional[dict] = None

    @classmethod
    def create(cls, num_workers: Any = 1, start_method: Any = UNSET, pickler: Any = None,
               backend: Any = "processes", ray_options: Any = None) -> "PoolOptions":
        from extsrc.engine.pickling import Pickler

        backend = check_backend("backend", backend)
        if backend == "ray":
            if start_method is not UNSET:
                raise ValueError(
                    f"start_method={start_method!r} chooses how worker processes start "
                    "(backend='processes'); with backend='ray' the workers are Ray actors: drop it"
                )
            start_method = None
            ray_options = check_ray_options("ray_options", ray_options)
        else:
            if start_method is UNSET:
                start_method = "fork"
            if start_method not in START_METHODS:
                raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
            if ray_options is not None:
                raise ValueError(f"ray_options is for backend='ray', got it with backend={backend!r}")
        return cls(positive_int("num_workers", num_workers), start_method, Pickler(pickler), backend,
                   ray_options)


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
                            ("stats", stats)):
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
            prefetch=(default_prefetch(num_workers, tasks_per_worker) if prefetch is None
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
        )
