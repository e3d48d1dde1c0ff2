"""The loaders from_dataset returns (made by :mod:`extsrc.torch.plans`), each with DataLoader's
attributes: :class:`InProcessLoader` (``num_workers=0``), :class:`DatasetLoader` (a map-style
dataset, over a :class:`~extsrc.torch.TorchLoader` it holds), :class:`IterableLoader`."""

from __future__ import annotations

import signal
import warnings
from typing import Any, Callable, Iterator, List, Optional, Protocol

import torch
from torch.utils.data import default_collate

from extsrc.engine import (EpochSupersededError, Flattener, first_ready, ForkedChildError, InternalError, PoolClosedError,
                           SharedMemoryError, SourceTimeoutError, WorkerDiedError)
from extsrc.torch.arguments import DATALOADER_ATTRIBUTES, Loading, draw_seed
from extsrc.torch.loader import LoopPosition, TorchLoader, parse_device, require_cuda
from extsrc.torch.structure import TENSOR_LEAVES, Collation
from extsrc.torch.tensors import map_tensors
from extsrc.torch.workers import OrderBatches, WorkerStart, fetch, grouped



class Plan(Protocol):
    """What a :class:`DatasetLoader` asks of its plan (:mod:`extsrc.torch.plans`, which imports
    this module): loaders of new workers, a loop's preparation, and what it can do."""

    renewable: bool  # each loop may run on new workers
    resumable: bool  # state_dict() / load_state_dict() work

    def torch_loader(self, start: WorkerStart) -> TorchLoader: ...

    def begin(self, epoch_idx: int) -> Optional[int]: ...

    def close(self) -> None: ...

# Errors after which the workers are gone or the loop was ended: the loop ends. Any other
# (from the dataset or collate_fn, a sample that cannot be collated) fails its batch alone.
_ENDS_THE_LOOP = (WorkerDiedError, SourceTimeoutError, SharedMemoryError, PoolClosedError,
                  ForkedChildError, EpochSupersededError, InternalError)


class _Attributes:
    """DataLoader's attributes, read-only once described (setting one raises ``ValueError``, as
    DataLoader does), ``len()`` as DataLoader computes it, and ``with``."""

    _args: Loading
    _initialized = False
    _loops_begun = 0
    dataset: Any  # and the other DATALOADER_ATTRIBUTES, set by _describe

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

    def _begin_loop(self) -> Optional[int]:
        """Draws from ``generator`` what a DataLoader draws when a loop begins: a new base seed
        for the loop's workers (the first loop's was drawn when the loader was made; persistent
        workers keep theirs), so that a sampler sharing the generator gives the DataLoader's
        indices. The seed, or None when the workers of the last loop go on."""
        seed, args = None, self._args
        if self._loops_begun and not (args.persistent_workers and args.num_workers > 0):
            seed = draw_seed(args.generator)
        self._loops_begun += 1
        return seed

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()  # type: ignore[attr-defined]


class InProcessLoader(_Attributes):
    """``num_workers=0``: the dataset runs in this process, in the loop, as a DataLoader's does
    without workers (to debug it); the batches are those the workers would give."""

    def __init__(self, args: Loading):
        order = args.order
        self._batches = None if order is None else OrderBatches(order, args.batch_size, args.batches(len(order)))
        self._collate = None if args.default else args.collate_fn  # None: as the workers collate
        self._flatten, self._rebuild = Flattener(TENSOR_LEAVES), Collation()
        self._device = parse_device(args.device)  # refused or honoured as with workers
        if self._device is not None:
            require_cuda(f"device={args.device!r}")
            self._device = torch.device("cuda", torch.cuda.current_device() if self._device.index is None
                                        else self._device.index)
        self._next_epoch = 0
        self._resume = 0  # the batch the next loop begins at (load_state_dict)
        self._loop: Optional[_InProcessLoop] = None  # the last loop begun
        self._closed = False
        self._describe(args)

    def __iter__(self) -> Any:
        if self._closed:
            raise ValueError("this loader is closed")
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
                batch = self._rebuild.of_columns(self._flatten.columns(samples, "the batch"))
        if self._device is None:
            return batch
        return map_tensors(lambda tensor: tensor.to(self._device), batch)

    def state_dict(self) -> dict:
        """The epoch and the next batch a loop would get (the loader's own order only): after
        the last batch of a loop, before it ended, that epoch's end."""
        self._check_resumable("state_dict()")
        loop = self._loop
        if loop is not None and not loop.finished:
            return {"epoch_idx": self._next_epoch - 1, "iteration": loop.next}
        return {"epoch_idx": self._next_epoch, "iteration": self._resume}

    def load_state_dict(self, state_dict: dict) -> None:
        """Makes the next ``iter()`` resume at ``state_dict`` (from :meth:`state_dict`)."""
        self._check_resumable("load_state_dict()")
        try:
            epoch, iteration = int(state_dict["epoch_idx"]), int(state_dict["iteration"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"load_state_dict: expected a dict with epoch_idx and iteration (from "
                             f"state_dict()), got {state_dict!r}") from None
        if epoch < 0 or iteration < 0:
            raise ValueError(f"load_state_dict: epoch_idx and iteration must be >= 0, got {state_dict!r}")
        self._next_epoch, self._resume, self._loop = epoch, iteration, None

    def _check_resumable(self, what: str) -> None:
        if self._batches is None:
            raise TypeError(f"{what} needs a map-style dataset without a sampler, batch_sampler or "
                            "generator: an iterable dataset or a sampler cannot be rewound")

    def close(self) -> None:
        self._closed = True


class _InProcessLoop:
    """One loop of an :class:`InProcessLoader`: ``make(part)`` of each next part (indices, or
    an iterable's samples); a batch that raises is not made again, the loop goes on."""

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


class DatasetLoader(_Attributes):
    """A map-style dataset loaded by workers: the batches of a :class:`~extsrc.torch.TorchLoader`
    it holds (``source``, ``device``, ``state_dict()`` are that loader's), with DataLoader's
    attributes (``sampler`` and ``batch_sampler`` describe the order as a DataLoader's would).
    Without persistent workers, each loop after the first runs on new workers."""

    def __init__(self, plan: Plan, args: Loading):
        self._plan = plan
        self._loader = plan.torch_loader(WorkerStart(args.dataset, args.base_seed, args.worker_init_fn))
        self._renews = not args.persistent_workers and plan.renewable
        self._position: Optional[LoopPosition] = None  # of the last loop begun
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
        self._renew_workers(self._begin_loop())
        count = self._plan.begin(self.source.next_epoch_idx)
        if count == 0:  # no batch this epoch: a DataLoader's loop ends at once
            self._end_loop("a newer iter(loader)")
            return iter(())
        return _Loop(self, self._loop(), len(self.source) if count is None else count)

    def _loop(self) -> Any:
        epoch = self._loader.__iter__()
        self._position = epoch.position
        return epoch

    def _end_loop(self, why: str) -> None:
        if self._position is not None:
            self._position.ended_by = why

    def _renew_workers(self, base_seed: Optional[int]) -> None:
        """At a loop after the first, without persistent workers: new workers load it from
        where the old source stood."""
        if base_seed is None or not self._renews:
            return
        if self._fresh is not None:  # made by load_state_dict, its workers not started yet
            self._fresh.base_seed = base_seed
            self._fresh = None
            return
        position, source = self._position, self.source
        if position is not None and not position.finished:  # the last loop was left unfinished
            self._replace(base_seed, {"epoch_idx": source.next_epoch_idx, "iteration": 0})
        else:
            self._replace(base_seed, source.get_state())  # the next epoch, or load_state_dict's

    def _replace(self, base_seed: int, state: dict) -> WorkerStart:
        """Puts a loader of new workers at ``state`` in the place of the current one, whose
        source closes; the current one stays if anything (an interrupt) stops this half-way."""
        start = WorkerStart(self._args.dataset, base_seed, self._args.worker_init_fn)
        old, new = self._loader, self._plan.torch_loader(start)
        try:
            new.source.set_state(state)
            self._end_loop("a newer iter(loader)")
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
        if self._renews and position is self._position and self._fresh is None:
            self.source.close()
            self._stopped = True

    def state_dict(self) -> dict:
        """See :meth:`TorchLoader.state_dict`; ``TypeError`` with a sampler."""
        self._check_resumable("state_dict()")
        return self._loader.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """See :meth:`TorchLoader.load_state_dict`; ``TypeError`` as :meth:`state_dict`."""
        self._check_resumable("load_state_dict()")
        if self._stopped and self._fresh is None:
            # the last loop's workers stopped: the next loop's are made now, started at iter()
            self._fresh = self._replace(0, self.source.get_state())
        self._loader.load_state_dict(state_dict)
        self._end_loop("load_state_dict()")
        self._position = None

    def _check_resumable(self, what: str) -> None:
        if not self._plan.resumable:
            raise TypeError(f"{what} needs the loader's own order (no sampler, batch_sampler or "
                            "generator=): a sampler's epoch cannot be drawn again as it was")

    def close(self) -> None:
        """Stops the workers (see :meth:`TorchLoader.close`) and frees the sampler's indices."""
        self._closed = True
        self._loader.close()
        self._plan.close()

    def __repr__(self) -> str:
        return repr(self._loader)


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


class _Loop:
    """A loop of a :class:`DatasetLoader` of ``count`` batches. A batch that fails raises its
    error in its place and the loop goes on, as a DataLoader's (the engine's rule); an error
    after which the workers are gone or the loop was ended ends it, in DataLoader's words."""

    def __init__(self, loader: DatasetLoader, epoch: Any, count: int):
        self._loader = loader
        self._epoch = epoch
        self._count = count
        self._done = False

    def __iter__(self) -> "_Loop":
        return self

    def __len__(self) -> int:
        return self._count

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        epoch = self._epoch
        try:
            return epoch.__next__()
        except StopIteration:
            self._done = True
            self._loader._loop_finished(epoch.position)
            raise
        except _ENDS_THE_LOOP as exc:
            self._done = True
            in_dataloader_words(exc)
            raise


class IterableLoader(_Attributes):
    """An ``IterableDataset`` with workers: each worker iterates its copy of the dataset (shard
    it by ``get_worker_info()``) and forms batches, yielded in DataLoader's order, one from each
    worker in turn; each ``for`` loop is one pass of every worker."""

    def __init__(self, pool: Any, loaders: List[TorchLoader], seeds: Any, args: Loading):
        self._pool = pool
        self._loaders = loaders  # one per worker, its source pinned to that worker
        self._seeds = seeds  # a datapipe's shuffle seed of each epoch, read by the workers
        self._closed = False  # close() began: iter() refuses
        self._closed_fully = False  # close() ran to its end
        self._len_asked: Optional[int] = None  # len(dataset) when len() was last asked
        self._describe(args)

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
        return _WorkerTurns(self, [loader.__iter__() for loader in self._loaders])  # ends running loops

    def close(self) -> None:
        if self._closed_fully:
            return
        self._closed = True  # as TorchLoader.close: an interrupted close() is finished by the next
        for loader in self._loaders:
            loader.close()
        self._pool.close()
        if self._seeds is not None:
            self._seeds.close()
        self._closed_fully = True


class _WorkerTurns:
    """One loop of an :class:`IterableLoader`: its workers' loops in turn, skipping those done,
    or with ``in_order=False`` whichever has a batch first. Not a generator: an interrupt
    inside ``next()`` leaves it able to go on, and loses no batch."""

    def __init__(self, loader: IterableLoader, epochs: list):
        self._loader = loader
        self._active = list(epochs)
        self._turn = 0  # with in_order: the index in _active of the worker whose turn it is
        self._last: Any = None  # the worker loop that gave the last batch: the turn moves past it
        self._held: Any = None  # a batch taken and not handed on yet (an interrupt came between)
        self._yielded = 0

    def __iter__(self) -> "_WorkerTurns":
        return self

    def __next__(self) -> Any:
        held = self._held
        if held is not None:
            self._held = None
            return held
        if self._last is not None:
            if self._last in self._active:  # the turn passes
                self._turn = (self._active.index(self._last) + 1) % len(self._active)
            self._last = None
        while self._active:
            epoch = self._next_turn()
            try:
                batch = epoch.__next__()
            except StopIteration:
                self._done(epoch)
                continue
            except (WorkerDiedError, SourceTimeoutError) as exc:
                in_dataloader_words(exc)
                raise
            self._held = batch  # first: an interrupt below leaves it for the next call
            self._last = epoch
            self._yielded += 1
            self._warn_past_length()
            self._held = None
            return batch
        raise StopIteration

    def _done(self, epoch: Any) -> None:
        if epoch in self._active:
            index = self._active.index(epoch)
            self._active.remove(epoch)
            if index < self._turn:
                self._turn -= 1
            if self._turn >= len(self._active):
                self._turn = 0

    def _next_turn(self) -> Any:
        """The worker loop to take the next batch from (with ``in_order=False``, the first ready;
        past ``timeout``, the first, whose own wait raises the timeout naming what is stuck)."""
        loader = self._loader
        if loader._args.in_order:
            return self._active[self._turn]
        return first_ready(loader._pool, self._active, loader._args.timeout or None)

    def _warn_past_length(self) -> None:
        loader = self._loader
        if loader._len_asked is not None and self._yielded > loader._len_asked:
            # As a DataLoader warns, and when: more batches than len(dataset) (the workers' last
            # batches may be short), usually workers that each yield the whole dataset.
            warnings.warn(
                f"Length of IterableDataset {loader._args.dataset!r} was reported to be "
                f"{loader._len_asked} (len(dataset), when len(loader) was asked), but "
                f"{self._yielded} samples have been fetched. For multiprocessing data-loading, this "
                f"usually means that each of the {loader._args.num_workers} workers iterates its own copy "
                "of the dataset: shard it by torch.utils.data.get_worker_info() (or in "
                "worker_init_fn) so that together they yield len(dataset) samples. (What is "
                "counted is what the loader yielded, as DataLoader counts: batches when "
                "batch_size is set.)", UserWarning, stacklevel=3)
