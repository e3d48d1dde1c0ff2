"""What a pool and a source are asked to do: :class:`PoolSpec` and :class:`SourceSpec`.

Both are frozen records that check themselves where they are defined: making
one with a wrong value raises ``ValueError``/``TypeError`` saying which
argument is wrong, what was expected and what came, and a record that exists
is valid, so everything downstream trusts it. A ``bool`` is never accepted
where a number is expected (``num_workers=True`` is an error, not 1).
Defaults that depend on the pool (how far ahead to produce) are not decided
here but by :mod:`extsrc.engine.policy`.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from extsrc.arrays import DType
from extsrc.checks import is_int, is_number
from extsrc.engine.faults import OnError, check_on_error
from extsrc.engine.hooks import Hooks
from extsrc.order import Order

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from extsrc.engine.pickling import PicklerSpec

START_METHODS = ("fork", "spawn", "forkserver")
LAST_BATCH_POLICIES = ("drop", "partial", "pad")
# num_outputs=AUTO_OUTPUTS: each sample is a tuple of arrays, as many as the source's first
# sample has (learnt in the workers, so the consumer need not run the callback to know it).
AUTO_OUTPUTS = "auto"
# A source's dtype= and ndim=: one value for every output, or one per output.
DTypes = Union[None, "DTypeLike", Sequence[Optional["DTypeLike"]]]
NDims = Union[None, int, Sequence[Optional[int]]]


class _Unset:
    """Marks an argument the caller did not give (so that an explicit default is told apart)."""

    _instance: Optional["_Unset"] = None

    def __new__(cls) -> "_Unset":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<unset>"

    def __reduce__(self) -> Tuple[type, Tuple[()]]:
        return (_Unset, ())


UNSET: Any = _Unset()  # untyped: the default of parameters of every type


# The checks below take whatever the caller passed, and say what is wrong with it.


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1, or ``ValueError`` naming ``name``."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as an int >= 0, or ``ValueError`` naming ``name``."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def optional_positive_int(name: str, value: Any) -> Optional[int]:
    return None if value is None else positive_int(name, value)


def non_negative_number(name: str, value: object) -> float:
    """``value`` if it is a number >= 0, or ``ValueError`` naming ``name``."""
    if not is_number(value) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return value


def check_backend(name: str, value: object, start_method: object = UNSET, options: object = None,
                  names: Tuple[str, str] = ("start_method", "ray_options"),
                  ) -> Tuple[str, Optional[str], Optional[Dict[str, Any]]]:
    """``(backend, start_method, backend options)`` checked: ``value`` must name a backend
    (see :mod:`extsrc.engine.backend`, whose module is imported now), which checks the other
    two (``names``: what they are called where they were given)."""
    from extsrc.engine.backend import backend_class, backend_names

    if not isinstance(value, str):
        raise ValueError(f"{name} must be one of {backend_names()}, got {value!r}")
    checked_method, checked_options = backend_class(value, name).check_options(
        start_method, options, (name, *names), UNSET)
    return value, checked_method, checked_options


def per_output(name: str, value: object, count: int) -> Tuple[object, ...]:
    """One value per output: a list/tuple must have ``count`` entries; anything else repeats."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} outputs: {value!r}")
        return tuple(value)
    return (value,) * count


def _dtype(value: Any, output: int) -> Optional[DType]:
    if value is None:
        return None
    try:
        dtype: DType = np.dtype(value)
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


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


@dataclass(frozen=True)
class PoolSpec:
    """How a :class:`~extsrc.WorkerPool` runs its workers.

    ``backend="processes"``: worker processes on this host, started with
    ``start_method`` (default ``"fork"``). ``backend="ray"``: Ray actors
    anywhere in the cluster, created with ``backend_options`` (the pool's
    ``ray_options``, checked by the Ray backend); ``start_method`` is then
    ``None``. ``pickler`` is a :class:`~extsrc.engine.pickling.Pickler` or what
    its constructor takes. ``worker_restarts``: how many lost workers the pool
    replaces over its life (their tasks redone) before a loss breaks it.
    """

    num_workers: int = 1
    start_method: Optional[str] = UNSET
    pickler: PicklerSpec = UNSET  # a Pickler or what Pickler() takes; made a Pickler here
    backend: str = "processes"
    backend_options: Optional[Dict[str, Any]] = None
    worker_restarts: int = 0

    def __post_init__(self) -> None:
        from extsrc.engine.pickling import Pickler

        backend, start_method, options = check_backend("backend", self.backend, self.start_method,
                                                       self.backend_options)
        _set(self, num_workers=positive_int("num_workers", self.num_workers),
             start_method=start_method, backend=backend, backend_options=options,
             worker_restarts=non_negative_int("worker_restarts", self.worker_restarts),
             pickler=self.pickler if isinstance(self.pickler, Pickler) else Pickler(
                 None if self.pickler is UNSET else self.pickler))


@dataclass(frozen=True)
class SourceSpec:
    """What a :class:`~extsrc.ParallelSource` produces and how far ahead.

    The fields are the source's arguments of the same names; its ``dtype``
    and ``ndim`` (one value, or one per output) are kept as ``dtypes`` and
    ``ndims``, one per output. ``prefetch=None`` leaves it to the policy
    (:func:`extsrc.engine.policy.default_prefetch`). ``stats`` is ``True``,
    ``False`` or a number of seconds: collect the statistics, and report them
    that often.
    """

    batch_size: int
    num_outputs: Union[None, int, str] = None  # None, a count, or AUTO_OUTPUTS
    batch: bool = False
    prefetch: Optional[int] = None
    last_batch: str = "drop"
    dtype: InitVar[DTypes] = None  # anything np.dtype() takes, or one per output
    ndim: InitVar[NDims] = None  # or one per output
    timeout: Optional[float] = None
    batches_held: int = 2
    order: Optional[Order] = None
    in_place: bool = False  # the callback gets a second argument to write samples into
    stats: Union[bool, float] = True
    concurrency: int = 1  # samples in flight at once per worker (extsrc.engine.concurrent)
    in_order: bool = True  # False: a finished batch may be handed out before earlier ones
    hooks: Hooks = field(default_factory=Hooks)
    on_error: OnError = "raise"  # "raise", "skip" or on_error(info, error) -> sample (faults.py)
    max_errors: Union[None, int, float] = None  # faults an epoch may have: a count or a fraction
    dtypes: Tuple[Optional[DType], ...] = field(init=False)  # one per output
    ndims: Tuple[Optional[int], ...] = field(init=False)  # one per output

    def __post_init__(self, dtype: DTypes, ndim: NDims) -> None:
        _set(self, batch_size=positive_int("batch_size", self.batch_size),
             batch=_flag("batch", self.batch), in_place=_flag("in_place", self.in_place),
             in_order=_flag("in_order", self.in_order),
             prefetch=optional_positive_int("prefetch", self.prefetch),
             batches_held=positive_int("batches_held", self.batches_held),
             concurrency=positive_int("concurrency", self.concurrency))
        self._check_outputs(dtype, ndim)
        self._check_modes()
        self._check_numbers()
        if not isinstance(self.hooks, Hooks):
            raise TypeError(f"hooks must be an extsrc.Hooks, got {type(self.hooks).__name__}")
        check_on_error(self.on_error, self.max_errors, None if self.order is None else len(self.order))
        if self.on_error == "skip" and self.batch:
            raise ValueError("on_error='skip' drops a sample from its batch: it needs sample mode "
                             "(batch=False); a batch callback can return a replacement batch "
                             "from on_error=callable")
        if self.hooks.batch_info and not self.batch:
            raise ValueError("hooks.batch_info=True needs batch=True (it is what a batch callback is given)")

    def _check_outputs(self, dtypes: DTypes, ndims: NDims) -> None:
        num_outputs = self.num_outputs
        if num_outputs == AUTO_OUTPUTS:
            if dtypes is not None or ndims is not None:
                raise ValueError(f"dtype= and ndim= need a known num_outputs, not {AUTO_OUTPUTS!r}")
            if self.in_place:
                raise ValueError(f"in_place=True needs a known num_outputs, not {AUTO_OUTPUTS!r}")
        else:
            num_outputs = optional_positive_int("num_outputs", num_outputs)
        outputs = 1 if num_outputs is None else 0 if isinstance(num_outputs, str) else num_outputs
        _set(self, num_outputs=num_outputs,
             dtypes=tuple(_dtype(d, j) for j, d in enumerate(per_output("dtype", dtypes, outputs))),
             ndims=tuple(_ndim(n, j) for j, n in enumerate(per_output("ndim", ndims, outputs))))

    def _check_modes(self) -> None:
        if self.last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {self.last_batch!r}")
        if self.order is not None:
            if not isinstance(self.order, Order):
                raise TypeError(f"order must be an extsrc.Order, got {type(self.order).__name__}")
            if self.batch:
                raise ValueError("order= gives each sample its record: it needs sample mode (batch=False)")
        if self.in_place and self.batch:
            raise ValueError("in_place=True hands a sample-mode callback room for each sample; it "
                             "needs batch=False")
        if self.last_batch == "pad" and self.order is None:
            raise ValueError(
                "last_batch='pad' fills the last batch with records from the start of the epoch's "
                "order, so it needs order= (an extsrc.Order)"
            )
        concurrency = self.concurrency
        if concurrency > 1 and self.batch:
            raise ValueError(
                f"concurrency={concurrency} keeps several samples in flight per worker: it needs "
                "sample mode (batch=False). A batch callback makes the whole batch: let it gather "
                "its requests itself (an async def callback runs on the worker's event loop)"
            )
        if concurrency > 1 and self.in_place:
            raise ValueError(f"in_place=True hands the callback room for one sample at a time; it "
                             f"cannot be combined with concurrency={concurrency}")

    def _check_numbers(self) -> None:
        if self.timeout is not None and (not is_number(self.timeout) or not self.timeout > 0):
            raise ValueError(f"timeout must be None or a positive number of seconds, got {self.timeout!r}")
        stats = self.stats
        if not isinstance(stats, (bool, np.bool_)) and (not is_number(stats) or not stats > 0):
            raise ValueError("stats must be True, False or a positive number of seconds (report "
                             f"that often), got {stats!r}")

    @property
    def collects_stats(self) -> bool:
        """Whether the statistics of ``ParallelSource.stats()`` are collected."""
        return bool(self.stats) or not isinstance(self.stats, (bool, np.bool_))

    @property
    def stats_every(self) -> Optional[float]:
        """Seconds between reports of the statistics, or None (``stats`` a number)."""
        return None if isinstance(self.stats, (bool, np.bool_)) else float(self.stats)

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
        return 1 if self.num_outputs is None else int(self.num_outputs)


def _set(record: object, **values: object) -> None:
    """Stores checked values into a frozen record, from its ``__post_init__``."""
    for name, value in values.items():
        object.__setattr__(record, name, value)
