"""The loaders from_dataset returns without a map-style dataset's workers, each with DataLoader's
attributes: :class:`InProcessLoader` (``num_workers=0``) and :class:`IterableLoader` (their
common part, :class:`Attributes`, is also :class:`~extsrc.torch.plans.DatasetLoader`'s)."""

from __future__ import annotations

import collections
import signal
import warnings
from typing import Any, Callable, Iterator, List, Optional

import torch
from torch.utils.data import IterDataPipe, default_collate

from extsrc.engine import (EpochSupersededError, EpochTable, Flattener, ForkedChildError, InternalError,
                           LoopPosition, PoolClosedError, SharedMemoryError, SourceTimeoutError, WorkerDiedError,
                           WorkerPool, first_ready, parse_state)
from extsrc.torch.arguments import DATALOADER_ATTRIBUTES, Loading, draw_seed
from extsrc.torch.loader import TorchLoader, cuda_device, parse_device
from extsrc.torch.structure import TENSOR_LEAVES, Collation
from extsrc.torch.tensors import map_tensors
from extsrc.torch.workers import OrderBatches, fetch, grouped


class Attributes:
    """DataLoader's attributes, read-only once described (setting one raises ``ValueError``, as
    DataLoader does), ``len()`` as DataLoader computes it, and ``with``."""

    _args: Loading
    _initialized = False
    _loops_begun = 0
    dataset: Any  # and the other DATALOADER_ATTRIBUTES, set by _describe
    close: Callable[[], None]  # each loader's own

    def _describe(self, args: Loading) -> None:
        self.__dict__.update(args.attributes)
        self._args = args
        self._initialized = True

    def __setattr__(self, name: str, value: Any) -> None:
        if self._initialized and name in DATALOADER_ATTRIBUTES:
            raise ValueError(f"{name} attribute should not be set after {type(self).__name__} is "
                             "initialized (it describes how the running workers load batches)")
        super().__setattr__(name, value)

    def __len__(self) -> int:
        """Batches per epoch, from ``len(dataset)`` now (as DataLoader's ``len()``); with
        ``shard=``, those of this shard; with a ``sampler``/``batch_sampler``, its ``len()``."""
        args, order = self._args, self._args.order
        if args.index_sampler is not None:
            return len(args.index_sampler)
        return args.batches(len(order) if order is not None and order.shard[1] > 1 else len(self.dataset))

    def _check_length(self) -> None:
        """A loop in the loader's own order, made for ``len(dataset)`` then, is refused once the
        dataset's length changed: it would load the records of the old length, not the new."""
        order = self._args.order
        if order is None:
            return
        now, then = len(self.dataset), order.num_records
        if now != then:
            loss = (f"leave out the {now - then} records added since" if now > then else
                    f"ask for {then - now} records the dataset no longer has")
            raise ValueError(
                f"len(dataset) is {now}, and was {then} when the loader was made: its own order "
                f"covers those {then} records, so a loop now would {loss}. Make a new "
                "loader for the new length, or give sampler=SequentialSampler(dataset) "
                "(RandomSampler(dataset) to shuffle), which is drawn again at each loop, as a "
                "DataLoader's")

    def _begin_loop(self) -> Optional[int]:
        """The new workers' base seed a DataLoader draws from ``generator`` as a loop begins (so that
        a sampler sharing it gives DataLoader's indices), or None where the last loop's go on."""
        seed, args = None, self._args
        if self._loops_begun and not (args.persistent_workers and args.num_workers > 0):
            seed = draw_seed(args.generator)
        self._loops_begun += 1
        return seed

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _check_resumable(self, what: str, resumable: bool) -> None:
        if not resumable:
            raise TypeError(f"{what} needs a map-style dataset in the loader's own order (no sampler, "
                            "batch_sampler or generator=): an iterable's or a sampler's epoch cannot be "
                            "drawn again as it was")


class InProcessLoader(Attributes):
    """``num_workers=0``: the dataset runs in this process, in the loop, as a DataLoader's does
    without workers (to debug it); the batches are those the workers would give."""

    def __init__(self, args: Loading):
        order = args.order
        self._batches = None if order is None else OrderBatches(order, args.batch_size, args.batches(len(order)))
        # None: the default collation, as the workers make it (with a sampler or __getitems__
        # too: WholeBatches' columns), each batch of a sampler in a structure of its own.
        sampled_default = args.collate_fn is default_collate and args.batch_sampler is not None
        self._collate = None if args.default or sampled_default else args.collate_fn
        self._per_batch = not args.default
        self._flatten, self._rebuild = Flattener(TENSOR_LEAVES), Collation()
        device = parse_device(args.device)  # refused or honoured as with workers
        self._device = None if device is None else cuda_device(device, f"device={args.device!r}")
        self._next_epoch = 0
        self._resume = 0  # the batch the next loop begins at (load_state_dict)
        self._loop: Optional[_InProcessLoop] = None  # the last loop begun
        self._closed = False
        self._describe(args)

    def __iter__(self) -> Any:
        if self._closed:
            raise ValueError("this loader is closed")
        self._check_length()
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        first, self._resume = self._resume, 0
        batches, args = self._batches, self._args
        if args.index_sampler is not None:  # drawn as the loop goes, as DataLoader's
            self._begin_loop()
            self._loop = _InProcessLoop(iter(args.index_sampler), self._fetched)
        elif batches is None:  # an IterableDataset
            self._loop = _InProcessLoop(grouped(iter(args.dataset), args.batch_size, args.drop_last),
                                        self._collated)
        else:
            indices = (batches.batch(epoch, k) for k in range(first, batches.count))
            self._loop = _InProcessLoop(indices, self._fetched, first)
        return self._loop

    def _fetched(self, indices: Any) -> Any:
        return self._collated(fetch(self._args.dataset, indices, self._args.batch_sampler is not None))

    device = property(lambda self: self._device or torch.device("cpu"), doc="Where the tensors are.")

    def _collated(self, samples: Any) -> Any:
        if self._collate is not None:
            batch = self._collate(samples)
        else:
            try:  # as DataLoader collates without workers: the same batch as the workers', at its speed
                batch = default_collate(samples)
            except Exception:  # the workers' way, whose error says which sample and field differ
                if not isinstance(samples, (list, tuple)):
                    raise  # __getitems__'s mapping: not samples to collate (the workers refuse it)
                flatten = Flattener(TENSOR_LEAVES) if self._per_batch else self._flatten
                batch = self._rebuild.of_columns(flatten.columns(list(samples), "the batch"))
        if self._device is None:
            return batch
        return map_tensors(lambda tensor: tensor.to(self._device), batch)

    def state_dict(self) -> dict:
        """The epoch and the next batch a loop would get (the loader's own order only): after
        the last batch of a loop, before it ended, that epoch's end."""
        self._check_resumable("state_dict()", self._batches is not None)
        loop = self._loop
        if loop is not None and not loop.finished:
            return {"epoch_idx": self._next_epoch - 1, "iteration": loop.next}
        return {"epoch_idx": self._next_epoch, "iteration": self._resume}

    def load_state_dict(self, state_dict: dict) -> None:
        """Makes the next ``iter()`` resume at ``state_dict`` (from :meth:`state_dict`)."""
        self._check_resumable("load_state_dict()", self._batches is not None)
        epoch, iteration = parse_state(state_dict, "load_state_dict", "state_dict()")
        self._next_epoch, self._resume, self._loop = epoch, iteration, None

    def close(self) -> None:
        self._closed = True


class _InProcessLoop:
    """An :class:`InProcessLoader`'s loop: ``make(part)`` of each part; a batch that raises is not retried."""

    def __init__(self, parts: Iterator[Any], make: Callable[[Any], Any], first: int = 0):
        self._parts = parts
        self._make = make
        self.next = first  # the batch the next next() makes
        self.finished = False  # the loop ended (StopIteration)

    def __iter__(self) -> "_InProcessLoop":
        return self

    def __next__(self) -> Any:
        try:
            part = next(self._parts)
        except StopIteration:
            self.finished = True
            raise
        self.next += 1  # first: a batch that raises is not tried again
        return self._make(part)


def in_dataloader_words(error: BaseException) -> None:
    """Puts the phrase of DataLoader's error for a dead worker or a timeout before an engine
    error's message (once), for code that matches DataLoader's; type and traceback stay."""
    if isinstance(error, WorkerDiedError) and error.pid is not None:
        if error.signal is not None:
            name = signal.strsignal(error.signal) or f"signal {error.signal}"
            phrase = f"DataLoader worker (pid {error.pid}) is killed by signal: {name}. "
        else:
            phrase = f"DataLoader worker (pid(s) {error.pid}) exited unexpectedly. "
    elif isinstance(error, SourceTimeoutError) and error.timeout is not None:
        phrase = f"DataLoader timed out after {error.timeout:g} seconds. "
    else:
        return
    if not str(error).startswith(phrase):
        error.args = (phrase + str(error),)


class IterableLoader(Attributes):
    """An ``IterableDataset`` with workers: each iterates its copy (shard it by ``get_worker_info()``)
    and forms batches, taken from each in turn as a DataLoader's; a loop is a pass of every worker."""

    def __init__(self, args: Loading, worker_loader: Callable[[WorkerPool, Optional[EpochTable], int], TorchLoader]):
        self._pool: Optional[WorkerPool] = None
        self._seeds: Optional[EpochTable] = None  # a datapipe's shuffle seed of each epoch
        self._loaders: List[TorchLoader] = []  # one per worker, its source pinned to that worker
        self._closed = False  # close() began: iter() refuses
        self._closed_fully = False  # close() ran to its end
        self._len_asked: Optional[int] = None  # len(dataset) when len() was last asked
        self._describe(args)
        try:
            self._pool = WorkerPool(args.num_workers, start_method=args.start_method, pickler=args.pickler,
                                    worker_restarts=args.worker_restarts)
            self._seeds = EpochTable() if isinstance(args.dataset, IterDataPipe) else None
            for worker in range(args.num_workers):
                self._loaders.append(worker_loader(self._pool, self._seeds, worker))
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        self._len_asked = len(self._args.dataset)
        return super().__len__()

    def __iter__(self) -> Any:
        if self._closed:
            raise ValueError("this loader is closed")
        if self._seeds is not None:
            # As DataLoader at each iter() of a datapipe: one shuffle seed for all workers, drawn
            # first (torch.manual_seed() before the loop decides it), published before the epoch.
            seed = draw_seed(self._args.generator)
            for epoch_idx in sorted({loader.source.next_epoch_idx for loader in self._loaders}):
                self._seeds.write(epoch_idx, [seed])
        self._begin_loop()  # then what a DataLoader draws for new workers (these persist)
        epochs = [loader.__iter__() for loader in self._loaders]  # ends running loops
        return WorkerLoop(epochs, self._args, pool=self._pool, yielded=self._warn_past_length)

    def close(self) -> None:
        if self._closed_fully:
            return
        self._closed = True  # as TorchLoader.close: an interrupted close() is finished by the next
        for loader in self._loaders:
            loader.close()
        if self._pool is not None:
            self._pool.close()
        if self._seeds is not None:
            self._seeds.close()
        self._closed_fully = True

    def _warn_past_length(self, yielded: int) -> None:
        if self._len_asked is not None and yielded > self._len_asked:
            # As a DataLoader warns, and when: more batches than len(dataset) (the workers' last
            # batches may be short), usually workers that each yield the whole dataset.
            warnings.warn(f"Length of IterableDataset {self._args.dataset!r} was reported to be {self._len_asked} "
                          f"(len(dataset), when len(loader) was asked), but {yielded} samples have been fetched. For "
                          f"multiprocessing data-loading, this usually means that each of the {self._args.num_workers} "
                          "workers iterates its own copy of the dataset: shard it by get_worker_info() (or in "
                          "worker_init_fn). (Counted is what the loader yielded: batches when batch_size is set.)",
                          UserWarning, stacklevel=3)


# Errors after which the workers are gone or the loop was ended: the loop ends. Any other
# (from the dataset or collate_fn, a sample that cannot be collated) fails its batch alone.
_ENDS_THE_LOOP = (WorkerDiedError, SourceTimeoutError, SharedMemoryError, PoolClosedError,
                  ForkedChildError, EpochSupersededError, InternalError)


def _handed(epoch: Any) -> Any:
    """What a TorchLoader's loop has handed on (batches, or errors in their place)."""
    position = epoch.position
    return None if position is None else (position.cursor.next, tuple(position.cursor.handed_out()))


class WorkerLoop:
    """A from_dataset loop with workers over its sources' epochs (a map-style dataset's one, an
    IterableDataset's one per worker), in turn or, with ``in_order=False``, the first with a batch. A
    failed batch raises in its place; an error that ends the workers or the loop ends it, in DataLoader's
    words. Not a generator: an interrupt in ``next()`` loses no batch. Calls ``ended(position)``."""

    def __init__(self, epochs: List[Any], args: Loading, count: Optional[int] = None,
                 pool: Optional[WorkerPool] = None, ended: Callable[[LoopPosition], None] = lambda position: None,
                 yielded: Callable[[int], None] = lambda count: None):
        self._active = collections.deque(epochs)
        self._args, self._count, self._pool = args, count, pool
        self._ended, self._on_yield = ended, yielded
        self._last: Any = None  # the epoch that gave the last batch: the turn moves past it
        self._held: Any = None  # a batch taken and not handed on yet (an interrupt came between)
        self._yielded = 0

    def __iter__(self) -> "WorkerLoop":
        return self

    def __len__(self) -> int:
        if self._count is None:
            raise TypeError("a loop over an IterableDataset has no len()")
        return self._count

    def __next__(self) -> Any:
        held, active = self._held, self._active
        if held is not None:
            self._held = None
            return held
        if self._last is not None and active and active[0] is self._last:
            active.rotate(-1)  # the turn passes
        self._last = None
        while active:
            # with in_order=False the first ready; past timeout, the first, whose wait raises
            epoch: Any = active[0]  # a TorchLoader's loop
            if not self._args.in_order and len(active) > 1 and self._pool is not None:
                epoch = first_ready(self._pool, list(active), self._args.timeout or None)
            # Only among several epochs taking turns does it matter whether an error took a
            # batch's place (the turn passes): one alone keeps the turn either way.
            handed = _handed(epoch) if len(active) > 1 else None
            try:
                batch = epoch.__next__()
            except StopIteration:
                active.remove(epoch)
                self._ended(epoch.position)
                continue
            except _ENDS_THE_LOOP as exc:
                active.clear()
                in_dataloader_words(exc)
                raise
            except BaseException:
                if handed is not None and _handed(epoch) != handed:  # the batch's error: the turn passes
                    self._last = epoch
                raise
            self._held = batch  # first: an interrupt below leaves it for the next call
            self._last = epoch
            self._yielded += 1
            self._on_yield(self._yielded)
            self._held = None
            return batch
        raise StopIteration
