"""What runs in a from_dataset loader's workers: their start, as a DataLoader worker's, and the
fetchers, as PyTorch's (``dataset[i]`` for each index of a batch, or an iterable's next samples)."""

from __future__ import annotations

import itertools
import random
from typing import Any, Callable, Iterator, List, Mapping, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch
from torch.utils.data import IterDataPipe, Subset, default_collate, get_worker_info, graph_settings
from torch.utils.data._utils import collate
from torch.utils.data._utils import worker as torch_worker

from extsrc.engine import HEAP_BUFFERS, NUMERIC_KINDS, EpochTable, Flattener, Order, RecordCache, pack_whole
from extsrc.torch.structure import TENSOR_LEAVES, holds_dtype

StackDataset = getattr(torch.utils.data, "StackDataset", None)  # PyTorch 2.2 and later


class WorkerStart:
    """Run in each worker before its first sample, as a DataLoader worker starts: one PyTorch
    thread (a forked child's first parallel op would wait forever for its parent's OpenMP
    threads), ``random``, NumPy and PyTorch seeded from ``base_seed`` and the worker's index,
    ``get_worker_info()``, a datapipe sharded, then the user's ``worker_init_fn(worker_id)``."""

    def __init__(self, dataset: Any, base_seed: int, worker_init_fn: Optional[Callable[[int], None]]):
        self.dataset = dataset
        self.base_seed = base_seed
        self.worker_init_fn = worker_init_fn

    def __call__(self, worker_index: int, num_workers: int) -> None:
        torch.set_num_threads(1)
        seed = self.base_seed + worker_index  # as a DataLoader seeds its worker `worker_index`
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(np.random.SeedSequence([self.base_seed, worker_index]).generate_state(4))
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=worker_index, num_workers=num_workers, seed=seed, dataset=self.dataset)
        if isinstance(self.dataset, IterDataPipe):
            graph_settings.apply_sharding(self.dataset, num_workers, worker_index)
        stack_in_worker_memory()
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_index)


def stack_in_worker_memory() -> None:
    """Makes ``default_collate`` (called by a user's ``collate_fn``, or for the default collation
    of whole batches) stack tensors in the worker's memory. In a DataLoader's worker it
    stacks each into a new torch shared-memory file, which a DataLoader sends as it is; here
    ``pack_whole`` copies the batch into the batch's shared memory anyway, so the file only cost
    its making and its pages' first touch: a ``collate_fn`` calling ``default_collate`` on a
    3x32x32 tensor and an int per sample made 65-75k samples/s with it, 83-125k without. A
    collation for tensors that someone set in place of PyTorch's own stays."""
    if collate.default_collate_fn_map.get(torch.Tensor) is collate.collate_tensor_fn:
        collate.default_collate_fn_map[torch.Tensor] = _stacked


def _stacked(batch: List[torch.Tensor], *, collate_fn_map: Optional[dict] = None) -> torch.Tensor:
    """``collate_tensor_fn`` without its shared-memory file: stacked into a tensor of the worker's
    memory shaped as PyTorch's (so in the first sample's dtype, and failing where it fails: other
    dtypes it cannot cast to, samples that need grad), or by PyTorch's own for the tensors it
    refuses (nested, sparse), which raises its error."""
    first = batch[0]
    if first.is_nested or first.layout != torch.strided:
        return collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    numel = sum(sample.numel() for sample in batch)
    return torch.stack(batch, 0, out=first.new_empty(numel).resize_(len(batch), *first.shape))


def round_robin(iteration: int, num_workers: int) -> int:
    """``Hooks.assign`` as DataLoader: batch ``iteration`` by worker ``iteration % num_workers``."""
    return iteration % num_workers


def any_worker(iteration: int, num_workers: int) -> None:
    """``Hooks.assign`` as DataLoader with ``in_order=False``: each batch by a worker with room."""
    return None


def _note(error: Exception, call: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"(extsrc.torch: raised by {call})")


def fetches_batches(dataset: Any) -> bool:
    """Whether a batch of ``dataset`` must be fetched by one ``dataset.__getitems__(indices)`` call,
    as a DataLoader fetches it, rather than by ``dataset[i]`` for each index: it has one (not
    ``None``), other than a ``Subset``'s or ``StackDataset``'s over datasets without one (those
    give what ``dataset[i]`` gives, and the samples then go to shared memory one by one)."""
    method = getattr(dataset, "__getitems__", None)
    if not method:
        return False
    function = getattr(method, "__func__", None)
    owner: Any = getattr(method, "__self__", None)  # the Subset or StackDataset the method is of
    if function is Subset.__getitems__:
        return fetches_batches(owner.dataset)
    if StackDataset is not None and function is StackDataset.__getitems__:
        inner = owner.datasets.values() if isinstance(owner.datasets, dict) else owner.datasets
        return any(fetches_batches(part) for part in inner)
    return True


def fetch(dataset: Any, indices: Any, batched: bool) -> Any:
    """As DataLoader's map fetcher: the samples at ``indices`` (by ``dataset.__getitems__(indices)``
    where :func:`fetches_batches`), or (not ``batched``) the one at the index ``indices``; an error
    gets a note naming the index, or the call."""
    if not batched:
        return _item(dataset, indices)
    if fetches_batches(dataset):
        try:
            return dataset.__getitems__(indices)
        except Exception as exc:
            _note(exc, f"dataset.__getitems__({_shown(indices)})")
            raise
    samples = []
    index = None
    try:
        for index in indices:  # a loop, not a call per index: the note needs the index
            samples.append(dataset[index])
    except Exception as exc:
        _note(exc, f"dataset[{index!r}]")
        raise
    return samples


def _shown(indices: Any) -> str:
    """A batch's indices for a message: all of a short batch, the ends of a long one."""
    shown = list(indices)
    if len(shown) <= 8:
        return repr(shown)
    return f"[{shown[0]!r}, {shown[1]!r}, ..., {shown[-1]!r}] ({len(shown)} indices)"


def _item(dataset: Any, index: Any) -> Any:
    try:
        return dataset[index]
    except Exception as exc:
        _note(exc, f"dataset[{index!r}]")
        raise


def grouped(samples: Iterator[Any], size: Optional[int], drop_last: bool) -> Iterator[Any]:
    """As DataLoader's iterable fetcher: lists of ``size`` samples (the last one shorter, or
    dropped with ``drop_last``), or each sample alone (not in a list) with ``size=None``."""
    while True:
        batch = list(itertools.islice(samples, size or 1))
        if not batch or (size is not None and len(batch) < size and drop_last):
            return
        yield batch if size is not None else batch[0]
        if len(batch) < (size or 1):
            return


class DatasetSamples:
    """The default collation's callback (sample mode): ``dataset[info.record]``, flattened."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.flatten = Flattener(TENSOR_LEAVES, advice=(
            ". For samples whose fields change from batch to batch (datasets of other keys joined, "
            "fields only some records have), give collate_fn=lambda samples: default_collate(samples), "
            "which collates each batch alone in the worker, as a DataLoader does"))
        self._single = Flattener(TENSOR_LEAVES)(np.zeros(0), "")[0]  # the structure of one array
        self._numeric: Optional[np.dtype] = None  # the dtype of the last numeric array sample

    def __call__(self, info: Any) -> Any:
        # _item() and shaped() written out: this runs once per sample, and the common case
        # (a NumPy array) needs no description of where the sample came from.
        record = info.record
        try:
            sample = self.dataset[record]
        except Exception as exc:
            _note(exc, f"dataset[{record!r}]")
            raise
        if type(sample) is np.ndarray:
            dtype = sample.dtype
            if dtype is self._numeric or (dtype.kind in NUMERIC_KINDS and dtype.isnative):
                self._numeric = dtype  # the last numeric dtype: the next sample's, mostly
                return self._single, sample
        # A sample shaped like the first (learnt), else walked and named for its error.
        return self.flatten.learned(sample) or self.flatten.walk(sample, f"dataset[{record}]")

    def shaped(self, sample: Any, where: str) -> Any:
        """``sample`` as the engine takes it (its structure, then its arrays)."""
        if type(sample) is np.ndarray and sample.dtype.kind in NUMERIC_KINDS and sample.dtype.isnative:
            return self._single, sample  # the common case, first; the engine checks the rest
        return self.flatten(sample, where)

    def replaced(self, on_error: Callable[[Any, Exception], Any], info: Any, error: Exception) -> Any:
        """A user's ``on_error(info, error)`` sample, shaped as ``dataset[i]``'s (in the worker)."""
        return self.shaped(on_error(info, error), f"on_error's sample for {info.record}")


class AsyncDatasetSamples(DatasetSamples):
    """:class:`DatasetSamples` awaiting a dataset's ``async def getitem_async(index)``."""

    async def __call__(self, info: Any) -> Any:
        record = info.record
        try:
            sample = await self.dataset.getitem_async(record)
        except Exception as exc:
            _note(exc, f"dataset.getitem_async({record})")
            raise
        return self.shaped(sample, f"dataset.getitem_async({record})")


class OrderBatches:
    """The batches of indices of the loader's own order (each record alone with
    ``batch_size=None``), computed where they are read, as an ``EpochTable``'s are read."""

    def __init__(self, order: Order, batch_size: Optional[int], count: int):
        self.order = order
        self.batch_size = batch_size
        self.count = count  # batches per epoch
        self._records: Optional[RecordCache] = None  # made where it is read

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_records": None}

    def batch(self, epoch_idx: int, k: int) -> Union[int, List[int]]:
        if self._records is None:
            self._records = RecordCache(self.order)
        if self.batch_size is None:
            return self._records.get(epoch_idx, k, k + 1)[0]
        start = k * self.batch_size
        return self._records.get(epoch_idx, start, min(start + self.batch_size, len(self.order)))


class PackedColumns(NamedTuple):
    """A batch as the columns of its samples (the structures first), packed by
    :class:`IndexedBatches` for :class:`~extsrc.torch.structure.Collation` to rebuild."""

    columns: Tuple[Any, ...]


class IndexedBatches:
    """Workers' callback making whole batches: batch ``k`` of epoch ``e``, ``indices.batch(e, k)``,
    fetched, collated by ``collate_fn`` (``None``: the default collation, see :meth:`collated`)
    and packed whole (:func:`~extsrc.engine.pack_whole`)."""

    def __init__(self, dataset: Any, collate_fn: Optional[Callable[[Any], Any]],
                 indices: Union[OrderBatches, EpochTable], batched: bool):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.indices = indices
        self.batched = batched

    def __call__(self, info: Any, buffers: Any) -> Any:
        indices = self.indices.batch(info.epoch_idx, info.idx_in_epoch)
        samples = fetch(self.dataset, indices, self.batched)
        if self.collate_fn is not None:
            return pack_whole(self.collate_fn(samples), buffers, f"collate_fn's batch {info.idx_in_epoch}",
                              TENSOR_LEAVES)
        if isinstance(samples, Mapping):  # default_collate would take its key 0 as the first sample
            raise TypeError(
                f"dataset.__getitems__({_shown(indices)}) returned a {type(samples).__name__}, and the "
                "default collation takes a list of samples, one per index, as a DataLoader's "
                "default_collate does: return a list, or give a collate_fn that takes what "
                "__getitems__ returns")
        where = f"batch {info.idx_in_epoch}"
        return pack_whole(self.collated(samples, where), buffers, where, TENSOR_LEAVES)

    def collated(self, samples: List[Any], where: str) -> Any:
        """The default collation's batch of ``samples``: ``default_collate``'s, or where it fails
        and :func:`packed_columns` can (a field whose samples differ in shape), the columns.
        ``default_collate`` first: the columns (each tensor converted to NumPy, then stacked)
        made 142-147k samples/s of 3x32x32 float tensors against 190-201k, 117-122k of dicts of
        such a tensor and an int against 173-178k (2 workers, batch 128, a sampler given), the
        same on NumPy arrays. Trying it first on every batch of a ragged field costs 0-4%
        (43.5-45.7k against 43.6-46.9k samples/s with columns first once one was ragged)."""
        try:
            return default_collate(samples)
        except Exception:
            columns = packed_columns(samples, where)
            if columns is None:
                raise  # the columns cannot be made either: default_collate's error, as DataLoader's
            return columns

def packed_columns(samples: Any, where: str) -> Optional[PackedColumns]:
    """The default collation's batch of ``samples`` as columns, or None where ``default_collate``
    must make it (as DataLoader's would): not a list of samples of one structure, a column of
    mixed dtypes (collated in the first sample's) or of a dtype PyTorch cannot hold (float128).
    Columns give a field whose samples differ in shape as a list of tensors, where
    ``default_collate`` raises. (They were 1.2-1.9x as fast as ``default_collate`` making a torch
    shared-memory file per tensor; since :func:`stack_in_worker_memory` removed it, they are
    slower, and :meth:`IndexedBatches.collated` asks ``default_collate`` first.)"""
    if not isinstance(samples, (list, tuple)) or not samples:
        return None
    try:  # a Flattener of this batch: each batch of a sampler may have a structure of its own
        flat = Flattener(TENSOR_LEAVES).columns(list(samples), where)
    except (TypeError, ValueError):
        return None
    stacked: List[Any] = []
    for column in flat:
        first = column[0]
        if not holds_dtype(first.dtype) or any(a.dtype != first.dtype for a in column):
            return None
        # A field whose samples differ in shape: a list of tensors, as the default collation's.
        # Tensors, not NumPy arrays: a whole batch gives NumPy's back as NumPy's.
        stacked.append(torch.from_numpy(np.stack(column)) if all(a.shape == first.shape for a in column)
                       else [torch.from_numpy(np.require(a, requirements="W")) for a in column])
    return PackedColumns(tuple(stacked))


class IterableBatches:
    """One worker's source of an ``IterableDataset``: each pass iterates the worker's copy and yields
    its batches as a DataLoader worker forms them, flattened or made by ``collate_fn``, packed."""

    def __init__(self, batch_size: Optional[int], drop_last: bool,
                 collate_fn: Optional[Callable[[Any], Any]], seeds: Optional[EpochTable]):
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn  # None: default collation, in shared memory
        self.flatten = Flattener(TENSOR_LEAVES)
        self.seeds = seeds  # a datapipe's: each epoch's shuffle seed, written by the consumer
        self.epoch_seed: Optional[int] = None

    def begin_epoch(self, epoch_idx: int) -> None:
        """``Hooks.begin_epoch``: the datapipe's seed the loader drew at this epoch's ``iter()``."""
        if self.seeds is not None:
            self.epoch_seed = self.seeds.read(epoch_idx)[0]

    def __iter__(self) -> "WorkerPass":
        info = get_worker_info()
        assert info is not None, "iterated in a worker of the loader"
        if isinstance(info.dataset, IterDataPipe) and self.epoch_seed is not None:
            # the same seed in every worker, as DataLoader's: shuffled alike, then sharded
            graph_settings.apply_random_seed(info.dataset, torch.Generator().manual_seed(self.epoch_seed))
        return WorkerPass(self, grouped(iter(info.dataset), self.batch_size, self.drop_last))

    def packed(self, batch: List[Any], where: str) -> Any:
        """A batch of samples as the engine writes it: columns, or ``collate_fn``'s batch packed."""
        if self.collate_fn is None:
            return self._columns(batch, where)
        description, buffer = pack_whole(self.collate_fn(batch), HEAP_BUFFERS, f"collate_fn's {where}",
                                         TENSOR_LEAVES)
        return [description], [buffer]

    def _columns(self, batch: List[Any], where: str) -> Any:
        """A batch of the default collation as the engine's columns, in the structure of the
        worker's first batch, which fixed the source's outputs; ``TypeError`` saying what to
        do for a batch that differs from it and would be collated alone."""
        try:
            return self.flatten.columns(batch, where)
        except TypeError as exc:
            try:
                Flattener(TENSOR_LEAVES).columns(batch, where)
            except (TypeError, ValueError):
                raise exc from None  # wrong in itself: the error says where
            raise TypeError(
                f"{where} has another structure than the worker's first batch ({exc}). The default "
                "collation writes an IterableDataset's batches in the structure of each worker's "
                "first; for batches whose fields change (buckets of lists, tasks of other keys), give "
                "collate_fn=lambda samples: default_collate(samples), which collates each batch in "
                "the worker as a DataLoader's does") from None


class WorkerPass:
    """A pass of a worker over its copy of an ``IterableDataset``: its batches, each packed by
    :meth:`IterableBatches.packed`. A batch that cannot be packed (``collate_fn`` raised, its
    fields changed) raises in its place, and the next ``next()`` goes on with the next batch,
    as a DataLoader worker does; a generator would end at the first error, and lose the
    worker's later batches. An error of the dataset's own iterator ends the pass."""

    def __init__(self, source: IterableBatches, batches: Iterator[Any]):
        self._source = source
        self._batches = enumerate(batches)

    def __iter__(self) -> "WorkerPass":
        return self

    def __next__(self) -> Any:
        count, batch = next(self._batches)
        return self._source.packed(batch, f"batch {count} of this worker")
