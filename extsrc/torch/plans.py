"""The loader for each kind of dataset, picked by :func:`loader_for`, and a map-style dataset's
:class:`DatasetLoader`, whose workers run one of two plans: :class:`SharedMemory` (the loader's
own order, collated in shared memory) or :class:`WholeBatches` (batches made by ``collate_fn``)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch
from torch.utils.data import IterableDataset, default_collate

from extsrc.engine import (AUTO_OUTPUTS, EpochTable, Hooks, LoopPosition, Order, ParallelSource, PoolSpec, WorkerPool,
                           is_async)
from extsrc.torch.arguments import DEFAULT_PREFETCH_FACTOR, Loading
from extsrc.torch.loader import TorchLoader
from extsrc.torch.loaders import Attributes, InProcessLoader, IterableLoader, WorkerLoop
from extsrc.torch.structure import Collation, unpack_whole
from extsrc.torch.workers import (AsyncDatasetSamples, DatasetSamples, IndexedBatches, IterableBatches,
                                  OrderBatches, PackedColumns, WorkerStart, any_worker, round_robin)


def loader_for(args: Loading) -> Union[InProcessLoader, DatasetLoader, IterableLoader]:
    """The loader for what ``args`` asks (its workers start at its first loop)."""
    if args.num_workers == 0:
        return InProcessLoader(args)
    if isinstance(args.dataset, IterableDataset):
        return IterableLoader(args, functools.partial(_worker_loader, args))
    plan = SharedMemory(args) if args.default else WholeBatches(args)
    try:
        return DatasetLoader(plan, args)
    except BaseException:
        plan.close()
        raise


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

    def _source(self, callback: Any, batch_size: int, start: WorkerStart, name: str = "",
                **shape: Any) -> ParallelSource:
        """A source of ``num_workers`` workers, as DataLoader's: ``prefetch_factor`` batches ahead
        per worker (else the engine's default), batch i made whole by worker i % num_workers."""
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
        on_error = functools.partial(samples.replaced, args.on_error) if callable(args.on_error) else args.on_error
        return self._source(samples, args.batch_size, start, num_outputs=AUTO_OUTPUTS,
                            order=args.order, concurrency=args.concurrency,
                            on_error=on_error, max_errors=args.max_errors,
                            last_batch="drop" if args.drop_last else "partial")


class WholeBatches(WorkerPlan):
    """Batches of indices fetched and collated by ``collate_fn`` in a worker, packed whole: a
    sampler's, drawn here as each loop begins (into an :class:`EpochTable`), or the own order's.
    ``default_collate``'s batches (with a sampler, or a dataset's ``__getitems__``) come as
    columns that :class:`Collation` rebuilds, as the default collation's."""

    def __init__(self, args: Loading):
        super().__init__(args)
        self.columns = args.collate_fn is default_collate and args.batch_sampler is not None
        self.rebuild = _Columns(Collation()) if self.columns else unpack_whole
        order = args.order
        self.resumable = order is not None
        self.indices = EpochTable() if order is None else OrderBatches(order, args.batch_size,
                                                                     args.batches(len(order)))

    def source(self, start: WorkerStart) -> ParallelSource:
        args, indices = self.args, self.indices
        batches = IndexedBatches(args.dataset, None if self.columns else args.collate_fn, indices,
                                 args.batch_sampler is not None)
        if isinstance(indices, OrderBatches):
            return self._source(batches, 1, start, num_outputs=2, in_place=True, order=Order(indices.count),
                                last_batch="drop" if args.drop_last else "partial")
        return self._source(batches, 1, start, ", sampler", num_outputs=2, in_place=True, last_batch="partial")

    def begin(self, epoch_idx: int) -> Optional[int]:
        if isinstance(self.indices, OrderBatches):
            return None
        # One epoch of the sampler, drawn as a DataLoader's iterator draws it: its batches of
        # indices (a comprehension: list() would ask the sampler's len(), which may raise).
        sampler = self.args.index_sampler
        batches = [list(b) for b in sampler] if self.args.batch_sampler is not None else [i for i in sampler]
        if batches:
            self.indices.write(epoch_idx, batches)
        return len(batches)

    def close(self) -> None:
        if isinstance(self.indices, EpochTable):
            self.indices.close()


class _Columns:
    """A batch of the default collation (:class:`IndexedBatches` without a ``collate_fn``):
    :class:`PackedColumns` collated here, else the batch ``default_collate`` made in the worker."""

    def __init__(self, collation: Collation):
        self.collation = collation

    def __call__(self, tensors: Any) -> Any:
        batch = unpack_whole(tensors)
        return self.collation(batch.columns) if type(batch) is PackedColumns else batch


def _worker_loader(args: Loading, pool: WorkerPool, seeds: Optional[EpochTable], worker: int) -> TorchLoader:
    """An ``IterableDataset``'s loader of ``worker``: a source of ``pool`` pinned to that worker."""
    batches = IterableBatches(args.batch_size, args.drop_last, None if args.default else args.collate_fn, seeds)
    source = ParallelSource(
        batches, args.batch_size if args.default and args.batch_size else 1, batch=True,
        num_outputs=AUTO_OUTPUTS if args.default else 2, pool=pool,
        prefetch=args.prefetch_factor, last_batch="partial", timeout=args.timeout or None,
        name=f"from_dataset({type(args.dataset).__name__}), worker {worker}",
        # once per worker (it sets the worker up for every source of the pool)
        hooks=Hooks(worker_init=WorkerStart(args.dataset, args.base_seed, args.worker_init_fn) if worker == 0
                    else None, begin_epoch=IterableBatches.begin_epoch, dense_arrays=True))
    return TorchLoader._owning(source, device=args.device, pin_memory=_pinned(args),
                               rebuild=Collation() if args.default else unpack_whole)


class DatasetLoader(Attributes):
    """A map-style dataset's workers: the batches of the ``TorchLoader`` it holds (``source``, ``device``,
    ``state_dict()``) with DataLoader's attributes; without persistent workers, new ones each later loop."""

    def __init__(self, plan: WorkerPlan, args: Loading):
        self._plan = plan
        self._loader = plan.torch_loader(WorkerStart(args.dataset, args.base_seed, args.worker_init_fn))
        self._renews = not args.persistent_workers and plan.renewable
        self._stopped = False  # the last loop's workers stopped at its end
        self._fresh: Optional[WorkerStart] = None  # new workers load_state_dict made, not started
        self._closed = False
        self._describe(args)

    source = property(lambda self: self._loader.source, doc="The source of this loop's workers.")
    device = property(lambda self: self._loader.device, doc="Where the tensors are.")

    def __iter__(self) -> Any:
        """Starts the next epoch (a sampler's indices drawn now, as a DataLoader's iterator does)."""
        if self._closed:
            raise ValueError("this TorchLoader is closed")
        self._check_length()
        self._renew_workers(self._begin_loop())
        count = self._plan.begin(self.source.next_epoch_idx)
        if count == 0:  # no batch this epoch: a DataLoader's loop ends at once
            self._loader.end_loop("a newer iter(loader)")
            return iter(())
        return WorkerLoop([self._loader.__iter__()], self._args, len(self.source) if count is None else count,
                          ended=self._loop_finished)

    def _renew_workers(self, base_seed: Optional[int]) -> None:
        """At a loop after the first, without persistent workers: new workers load it from
        where the old source stood."""
        if base_seed is None or not self._renews:
            return
        if self._fresh is not None:  # made by load_state_dict, its workers not started yet
            self._fresh.base_seed = base_seed
            self._fresh = None
            return
        position, source = self._loader.position, self.source
        left = position is not None and not position.finished  # the last loop was left unfinished
        # then the next epoch from its start, else the source's next (or load_state_dict's)
        self._replace(base_seed, {"epoch_idx": source.next_epoch_idx, "iteration": 0} if left else source.get_state())

    def _replace(self, base_seed: int, state: dict) -> WorkerStart:
        """Puts a loader of new workers at ``state`` in the place of the current one, whose
        source closes; the current one stays if anything (an interrupt) stops this half-way."""
        start = WorkerStart(self._args.dataset, base_seed, self._args.worker_init_fn)
        old, new = self._loader, self._plan.torch_loader(start)
        try:
            new.source.set_state(state)
            old.end_loop("a newer iter(loader)")
            self._loader = new
        except BaseException:
            self._loader = old
            new.close()
            raise
        self._stopped = False
        old.source.close()  # batches of the last loop still held stay valid until dropped
        return start

    def _loop_finished(self, position: LoopPosition) -> None:
        """The loop at ``position`` ended: the last loop's workers, not persistent, stop now."""
        if self._renews and position is self._loader.position and self._fresh is None:
            self.source.close()
            self._stopped = True

    def state_dict(self) -> dict:
        """See :meth:`TorchLoader.state_dict`; ``TypeError`` with a sampler."""
        self._check_resumable("state_dict()", self._plan.resumable)
        return self._loader.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """See :meth:`TorchLoader.load_state_dict`; ``TypeError`` as :meth:`state_dict`."""
        self._check_resumable("load_state_dict()", self._plan.resumable)
        if self._stopped and self._fresh is None:
            # the last loop's workers stopped: the next loop's are made now, started at iter()
            self._fresh = self._replace(0, self.source.get_state())
        self._loader.load_state_dict(state_dict)  # ends the running loop

    def close(self) -> None:
        """Stops the workers (see :meth:`TorchLoader.close`) and frees the sampler's indices."""
        self._closed = True
        self._loader.close()
        self._plan.close()

    def __repr__(self) -> str:
        return repr(self._loader)
