"""One plan per kind of dataset (a :class:`Plan`: what runs where, and the loader), picked by
:func:`plan_for`: :class:`InProcess` (``num_workers=0``), :class:`SharedMemory` (the loader's
own order, collated in shared memory), :class:`WholeBatches` (batches made by ``collate_fn``
in the workers: a sampler's, or the own order's) and :class:`Iterable` (an IterableDataset)."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Protocol

import torch
from torch.utils.data import IterableDataset, IterDataPipe

from extsrc.engine import (AUTO_OUTPUTS, EpochTable, Hooks, Order, ParallelSource, PoolSpec, WorkerPool,
                           is_async)
from extsrc.torch.arguments import DEFAULT_PREFETCH_FACTOR, Loading
from extsrc.torch.loader import TorchLoader
from extsrc.torch.loaders import DatasetLoader, InProcessLoader, IterableLoader
from extsrc.torch.structure import Collation, unpack_whole
from extsrc.torch.workers import (AsyncDatasetSamples, DatasetSamples, IndexedBatches, IterableBatches,
                                  OrderBatches, Replacement, WorkerStart, any_worker, round_robin)


def draw_batches(index_sampler: Any, batched: bool) -> List[Any]:
    """One epoch of ``index_sampler``, iterated in this process when a loop begins, as
    DataLoader's iterator does: its batches of indices (each index alone when not ``batched``),
    published to the workers in an :class:`~extsrc.engine.EpochTable`."""
    # a comprehension, not list(): that would ask the sampler's len(), which may raise
    return [list(batch) for batch in index_sampler] if batched else [i for i in index_sampler]


class Plan(Protocol):
    """How from_dataset loads one kind of dataset."""

    def loader(self) -> Any:
        """The loader from_dataset returns (its workers start at its first loop)."""


def plan_for(args: Loading) -> Plan:
    """The plan for what ``args`` asks."""
    if args.num_workers == 0:
        return InProcess(args)
    if isinstance(args.dataset, IterableDataset):
        return Iterable(args)
    return SharedMemory(args) if args.default else WholeBatches(args)


class InProcess:
    """``num_workers=0``: the dataset runs in the loop, in this process."""

    def __init__(self, args: Loading):
        self.args = args

    def loader(self) -> InProcessLoader:
        return InProcessLoader(self.args)


def _pinned(args: Loading) -> bool:
    return args.pin_memory and torch.cuda.is_available()


class WorkerPlan:
    """A map-style dataset loaded by workers: a ``DatasetLoader`` over a ``TorchLoader`` of the
    plan's source (made anew for each loop without persistent workers)."""

    rebuild: Callable[[Any], Any]  # a source batch's tensors -> the batch
    resumable = True  # whether state_dict() can rewind the loader

    def __init__(self, args: Loading):
        self.args = args
        self.renewable = args.device is None and not _pinned(args)

    def source(self, start: WorkerStart) -> ParallelSource:
        raise NotImplementedError

    def begin(self, epoch_idx: int) -> Optional[int]:
        """Prepares a loop: its number of batches, or None for the source's ``len()``."""
        return None

    def close(self) -> None:
        pass

    def torch_loader(self, start: WorkerStart) -> TorchLoader:
        """A loader of a new source, whose workers ``start`` sets up; it closes the source."""
        args = self.args
        return TorchLoader._owning(self.source(start), device=args.device, pin_memory=_pinned(args),
                                   rebuild=self.rebuild)

    def loader(self) -> DatasetLoader:
        try:
            return DatasetLoader(self, self.args)
        except BaseException:
            self.close()
            raise

    def _source(self, callback: Any, batch_size: int, start: WorkerStart, name: str = "",
                **shape: Any) -> ParallelSource:
        """A source of ``num_workers`` workers, as DataLoader's: ``prefetch_factor`` batches
        ahead per worker (without one, the engine's default: as many, or more for small
        batches), batch i made whole by worker i % num_workers (with ``in_order=False`` by one
        with room)."""
        args = self.args
        prefetch = None if args.engine_prefetch else (args.prefetch_factor or DEFAULT_PREFETCH_FACTOR) * args.num_workers
        return ParallelSource(
            callback, batch_size, prefetch=prefetch,
            pool=PoolSpec(num_workers=args.num_workers, start_method=args.start_method,
                          worker_restarts=args.worker_restarts, pickler=args.pickler),
            timeout=args.timeout or None, name=f"from_dataset({type(args.dataset).__name__}{name})",
            hooks=Hooks(worker_init=start, assign=round_robin if args.in_order else any_worker,
                        dense_arrays=True),
            in_order=args.in_order, **shape)


class SharedMemory(WorkerPlan):
    """The loader's own order, default collation: the workers write each sample, flattened,
    into the batch's shared memory; :class:`Collation` rebuilds the batch."""

    def __init__(self, args: Loading):
        super().__init__(args)
        self.rebuild = Collation()

    def source(self, start: WorkerStart) -> ParallelSource:
        args = self.args
        assert args.batch_size is not None, "the default collation needs a batch_size"
        kind = AsyncDatasetSamples if is_async(getattr(args.dataset, "getitem_async", None)) else DatasetSamples
        samples = kind(args.dataset)
        on_error = Replacement(args.on_error, samples) if callable(args.on_error) else args.on_error
        return self._source(samples, args.batch_size, start, num_outputs=AUTO_OUTPUTS,
                            order=args.order, concurrency=args.concurrency,
                            on_error=on_error, max_errors=args.max_errors,
                            last_batch="drop" if args.drop_last else "partial")


class WholeBatches(WorkerPlan):
    """Batches of indices fetched and collated by ``collate_fn`` in a worker, packed whole: a
    sampler's, drawn here as each loop begins (into an :class:`EpochTable`), or the own order's."""

    rebuild = staticmethod(unpack_whole)

    def __init__(self, args: Loading):
        super().__init__(args)
        order = args.order
        self.resumable = order is not None
        self.indices = EpochTable() if order is None else OrderBatches(order, args.batch_size,
                                                                     args.batches(len(order)))

    def source(self, start: WorkerStart) -> ParallelSource:
        args, indices = self.args, self.indices
        batches = IndexedBatches(args.dataset, args.collate_fn, indices, args.batch_sampler is not None)
        if isinstance(indices, OrderBatches):
            return self._source(batches, 1, start, num_outputs=2, in_place=True, order=Order(indices.count),
                                last_batch="drop" if args.drop_last else "partial")
        return self._source(batches, 1, start, ", sampler", num_outputs=2, in_place=True, last_batch="partial")

    def begin(self, epoch_idx: int) -> Optional[int]:
        if isinstance(self.indices, OrderBatches):
            return None
        batches = draw_batches(self.args.index_sampler, self.args.batch_sampler is not None)
        if batches:
            self.indices.write(epoch_idx, batches)
        return len(batches)

    def close(self) -> None:
        if isinstance(self.indices, EpochTable):
            self.indices.close()


class Iterable:
    """An ``IterableDataset``: a pool of ``num_workers``, one source pinned to each."""

    def __init__(self, args: Loading):
        self.args = args

    def loader(self) -> IterableLoader:
        args = self.args
        pool = WorkerPool(args.num_workers, start_method=args.start_method, pickler=args.pickler,
                          worker_restarts=args.worker_restarts)
        seeds = EpochTable() if isinstance(args.dataset, IterDataPipe) else None
        start = WorkerStart(args.dataset, args.base_seed, args.worker_init_fn)
        loaders: List[TorchLoader] = []
        try:
            for worker in range(args.num_workers):
                batches = IterableBatches(args.batch_size, args.drop_last,
                                          None if args.default else args.collate_fn, seeds)
                source = ParallelSource(
                    batches, args.batch_size if args.default and args.batch_size else 1, batch=True,
                    num_outputs=AUTO_OUTPUTS if args.default else 2, pool=pool,
                    prefetch=args.prefetch_factor, last_batch="partial", timeout=args.timeout or None,
                    name=f"from_dataset({type(args.dataset).__name__}), worker {worker}",
                    # once per worker (it sets the worker up for every source of the pool)
                    hooks=Hooks(worker_init=start if worker == 0 else None,
                                begin_epoch=IterableBatches.begin_epoch, dense_arrays=True))
                loaders.append(TorchLoader._owning(source, device=args.device, pin_memory=_pinned(args),
                                                   rebuild=Collation() if args.default else unpack_whole))
            return IterableLoader(pool, loaders, seeds, args)
        except BaseException:
            for loader in loaders:
                loader.close()
            pool.close()
            if seeds is not None:
                seeds.close()
            raise
