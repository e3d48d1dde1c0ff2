"""from_dataset's arguments: DataLoader's, checked with DataLoader's phrases (code written for
DataLoader, PyTorch's tests among it, matches them) and translated into one :class:`Loading`."""

from __future__ import annotations

import math
import multiprocessing.context
import warnings
from dataclasses import InitVar, dataclass
from typing import Any, Callable, Dict, Optional

import torch
from torch.utils.data import BatchSampler, IterableDataset, IterDataPipe, RandomSampler, SequentialSampler
from torch.utils.data import default_collate, default_convert, graph_settings

from extsrc.engine import START_METHODS, EmptyEpochError, Order, usable_cpus
from extsrc.torch.workers import fetches_batches

# The DataLoader attributes of a from_dataset loader, read-only once it is made (as DataLoader's).
DATALOADER_ATTRIBUTES = (
    "dataset", "batch_size", "drop_last", "sampler", "batch_sampler", "num_workers", "collate_fn",
    "pin_memory", "timeout", "worker_init_fn", "prefetch_factor", "persistent_workers",
    "generator", "in_order", "multiprocessing_context",
)
DEFAULT_PREFETCH_FACTOR = 2  # DataLoader's: batches prepared ahead per worker
_NOT_MAPPED = {"pin_memory_device": "give device= ('cuda:N') for CUDA tensors, or pin_memory=True"}


def draw_seed(generator: Optional[torch.Generator]) -> int:
    """A seed drawn as DataLoader draws its seeds: from ``generator``, else PyTorch's global
    generator (so that ``torch.manual_seed()`` decides it)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


@dataclass
class Loading:
    """from_dataset's arguments, checked and translated when made (those named in
    :data:`DATALOADER_ATTRIBUTES` as the loader shows them), then what is decided from them."""

    dataset: Any
    batch_size: Optional[int]
    shuffle: Optional[bool]
    sampler: Any
    batch_sampler: Any
    seed: int
    shard: Any
    drop_last: bool
    num_workers: int
    collate_fn: Any
    generator: Optional[torch.Generator]
    worker_init_fn: Optional[Callable[[int], None]]
    multiprocessing_context: Any
    prefetch_factor: Optional[int]
    timeout: float
    persistent_workers: bool
    in_order: bool
    pin_memory: bool
    device: Any
    pickler: Any
    concurrency: int
    worker_restarts: int
    on_error: Any  # "raise", "skip" or on_error(info, error) -> sample (extsrc.engine.faults)
    max_errors: Any
    unknown: InitVar[Dict[str, Any]]
    # Decided here: the loader's own order (None: a sampler's or an iterable's), the sampler
    # drawn here at each loop (None: the own order), whether the samples are collated in
    # shared memory (default collation), the start method, the workers' base seed.
    order: Optional[Order] = None
    index_sampler: Any = None
    default: bool = False
    start_method: str = "fork"
    base_seed: int = 0
    engine_prefetch: bool = False  # no prefetch_factor given: the engine's own, which may go further

    def __post_init__(self, unknown: Dict[str, Any]) -> None:
        for name in unknown:
            if name in _NOT_MAPPED:
                raise TypeError(f"from_dataset does not take DataLoader's {name}=: {_NOT_MAPPED[name]}")
            raise TypeError(f"from_dataset() got an unexpected keyword argument {name!r}")
        self._check_combinations()
        self._check_values()
        self._translate()

    def _check_per_sample(self, feature: str, sampled: bool) -> None:
        """``feature`` needs samples loaded one by one: by workers, in the own order, default collation."""
        if self.iterable or self.num_workers == 0:
            raise ValueError(f"{feature} needs a map-style dataset loaded by workers (num_workers > 0); "
                             f"got {'an IterableDataset' if self.iterable else 'num_workers=0'}")
        if sampled or not self.default:
            raise ValueError(f"{feature} needs the loader's own order and the default collation (no "
                             "sampler, batch_sampler, generator=, collate_fn or dataset.__getitems__): "
                             "with them a worker fetches and collates a batch in one call")

    @property
    def iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)

    def _check_combinations(self) -> None:
        num_workers, iterable = self.num_workers, self.iterable
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers option should be non-negative: 0 loads in this process, "
                             f"N > 0 in N worker processes; got num_workers={num_workers!r}")
        if not iterable and not (hasattr(self.dataset, "__len__") and hasattr(self.dataset, "__getitem__")):
            raise TypeError(f"from_dataset needs a map-style dataset (__len__ and __getitem__) or a "
                            f"torch.utils.data.IterableDataset, got {type(self.dataset).__name__}")
        if iterable and self.shuffle not in (None, False) and not isinstance(self.dataset, IterDataPipe):
            raise ValueError(f"DataLoader with IterableDataset: expected unspecified shuffle option, but "
                             f"got shuffle={self.shuffle}: each worker iterates its copy of the dataset")
        if iterable and (self.sampler is not None or self.batch_sampler is not None):
            given = "sampler" if self.sampler is not None else "batch_sampler"
            raise ValueError(f"DataLoader with IterableDataset: expected unspecified {given} option, "
                             f"but got {given}={getattr(self, given)!r}: each worker iterates its copy "
                             "of the dataset")
        if self.sampler is not None and self.shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle: the sampler decides "
                             "the order; give shuffle=None")
        if self.batch_sampler is not None:
            if self.batch_size != 1 or self.shuffle or self.sampler is not None or self.drop_last:
                raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, "
                                 "sampler, and drop_last: the batch_sampler gives each batch's indices")
            self.batch_size, self.drop_last = None, False
        if self.collate_fn is not None and not callable(self.collate_fn):
            raise TypeError(f"collate_fn must be a callable or None, got {type(self.collate_fn).__name__}")
        if self.batch_size is None and self.drop_last and self.batch_sampler is None:
            raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive "
                             "with drop_last")

    def _check_values(self) -> None:
        self.shuffle = False if self.shuffle is None else self.shuffle
        for name in ("shuffle", "drop_last", "pin_memory", "persistent_workers", "in_order"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        prefetch, timeout = self.prefetch_factor, self.timeout
        if self.num_workers == 0 and prefetch is not None:
            raise ValueError("prefetch_factor option could only be specified in multiprocessing: give "
                             "num_workers > 0, or prefetch_factor=None")
        if self.num_workers == 0 and self.persistent_workers:
            raise ValueError("persistent_workers option needs num_workers > 0")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout option should be non-negative: seconds to wait for a batch "
                             f"(0: no limit), got timeout={timeout!r}")
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1):
            raise ValueError(f"prefetch_factor must be a positive int or None, got {prefetch!r}")
        if self.worker_init_fn is not None and not callable(self.worker_init_fn):
            raise TypeError(f"worker_init_fn must be a callable or None, got {type(self.worker_init_fn).__name__}")
        self.start_method = _start_method(self.multiprocessing_context, self.num_workers)
        cpus = usable_cpus()
        if self.num_workers > cpus:
            warnings.warn(
                f"from_dataset starts {self.num_workers} worker processes, and this process may use "
                f"{cpus} CPUs: excessive worker creation might get DataLoader running slow or even "
                "freeze, and from_dataset alike (each worker also holds memory); give num_workers of "
                "at most the CPUs", UserWarning, stacklevel=5)  # at the caller of from_dataset
        if self.pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True, and CUDA is not available here: the tensors are not pinned "
                          "(page-locked) memory", UserWarning, stacklevel=5)
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(self.generator).__name__}")

    def _translate(self) -> None:
        # As DataLoader draws its workers' base seed (from generator, else PyTorch's global one).
        self.base_seed = draw_seed(self.generator)
        # A user's sampler, or a shuffle drawn from a user's generator (RandomSampler's order,
        # as DataLoader's), is iterated in this process at each loop; the workers get its indices.
        sampled = not self.iterable and (self.sampler is not None or self.batch_sampler is not None
                                         or (bool(self.shuffle) and self.generator is not None))
        if sampled and (self.seed != 0 or self.shard is not None):
            raise ValueError(f"seed={self.seed!r} and shard={self.shard!r} decide the order of the loader's "
                             "own extsrc.Order; with a sampler, batch_sampler or generator= the sampler "
                             "decides it: give one or the other")
        if isinstance(self.dataset, IterDataPipe):  # DataLoader hands its shuffle setting to a datapipe
            self.dataset = graph_settings.apply_shuffle_settings(self.dataset, shuffle=self.shuffle)
        elif not self.iterable and not sampled:
            if len(self.dataset) == 0:
                raise ValueError("the dataset is empty (len(dataset) == 0)")
            self.order = Order(len(self.dataset), shuffle=bool(self.shuffle), seed=self.seed, shard=self.shard,
                               remainder="pad")
        # A map-style dataset with __getitems__ is fetched a batch per call, as DataLoader fetches
        # it: collated in the worker as a collate_fn's batch, not sample by sample.
        batched = not self.iterable and fetches_batches(self.dataset)
        self.default = (self.collate_fn in (None, default_collate) and self.batch_size is not None
                        and not sampled and not batched)
        if self.collate_fn is None:
            unbatched = self.batch_size is None and self.batch_sampler is None
            self.collate_fn = default_convert if unbatched else default_collate
        if self.sampler is None and not self.iterable:
            self.sampler = (RandomSampler(self.dataset, generator=self.generator) if self.shuffle
                            else SequentialSampler(self.dataset))
        if self.batch_sampler is None and self.batch_size is not None and not self.iterable:
            self.batch_sampler = BatchSampler(self.sampler, self.batch_size, self.drop_last)
        if sampled:
            self.index_sampler = self.batch_sampler if self.batch_sampler is not None else self.sampler
        if self.num_workers > 0:
            # Without a prefetch_factor, the engine's default prefetch: DataLoader's 2 batches per
            # worker, and further ahead for small batches (which a number given forbids).
            self.engine_prefetch = self.prefetch_factor is None
            self.prefetch_factor = self.prefetch_factor or DEFAULT_PREFETCH_FACTOR
        self._check_workers(sampled)

    def _check_workers(self, sampled: bool) -> None:
        """What only the workers' ways of loading refuse: concurrency, an epoch of no batch."""
        if self.concurrency != 1:
            self._check_per_sample(f"concurrency={self.concurrency}", sampled)
        if self.on_error != "raise" or self.max_errors is not None:
            self._check_per_sample(f"on_error={self.on_error!r}", sampled)
        order, size = self.order, self.batch_size
        if self.num_workers > 0 and order is not None and size is not None and self.drop_last and len(order) < size:
            raise EmptyEpochError(
                f"{len(order)} records (this shard's, of len(dataset) == {len(self.dataset)}) make no "
                f"batch of batch_size={size} with drop_last=True; give drop_last=False or a batch_size "
                f"of at most {len(order)} (a DataLoader would yield no batch at all)")

    @property
    def attributes(self) -> Dict[str, Any]:
        """DataLoader's attributes, as the loader shows them."""
        return {name: getattr(self, name) for name in DATALOADER_ATTRIBUTES}

    def batches(self, records: int) -> int:
        """Batches of an epoch of ``records``, as DataLoader's ``len()`` counts them."""
        if self.batch_size is None:
            return records
        return records // self.batch_size if self.drop_last else math.ceil(records / self.batch_size)


def _start_method(context: Any, num_workers: int) -> str:
    """The start method a ``multiprocessing_context`` names, checked as a DataLoader checks it
    (``ValueError`` for an unknown name or num_workers=0, ``TypeError`` for another object)."""
    if context is None:
        return "fork"
    if num_workers == 0:
        raise ValueError(f"multiprocessing_context={context!r} chooses how worker processes start: "
                         "it is for multi-process loading (num_workers > 0), but got num_workers=0, "
                         "which loads in this process; give num_workers > 0, or leave it out")
    if isinstance(context, str):
        method = context
    elif isinstance(context, multiprocessing.context.BaseContext):
        method = context.get_start_method()
    else:
        raise TypeError(f"multiprocessing_context option should be a valid context object "
                        f"(multiprocessing.get_context(...)) or a start method's name "
                        f"{START_METHODS}, got {type(context).__name__} {context!r}")
    if method not in START_METHODS:
        raise ValueError(f"multiprocessing_context option should specify a valid start method in "
                         f"{START_METHODS} (or be a multiprocessing context of one), got {context!r}")
    return method
