"""``from_dataset``: a map-style PyTorch ``Dataset`` run on the extsrc engine, as a DataLoader is.

``from_dataset(dataset, batch_size, shuffle=..., num_workers=..., ...)`` takes
the arguments of ``torch.utils.data.DataLoader`` that have a meaning here and
returns a :class:`DatasetLoader` (a :class:`~extsrc.torch.TorchLoader` with
DataLoader's attributes): each epoch visits ``extsrc.Order(len(dataset),
shuffle=..., seed=...)``, a worker calls ``dataset[info.record]`` for each
sample and writes it, flattened to arrays (:mod:`extsrc.torch.structure`),
into shared memory, and the loader gives the batch as tensors shaped as
DataLoader's default collation shapes them. The DataLoader arguments that do not map raise
``TypeError`` saying what to do instead.
"""

from __future__ import annotations

import functools
import math
import multiprocessing.context
import os
import random
import signal
import time
import warnings
from typing import Any, Callable, Optional, Tuple, Union

import numpy as np
import torch
from torch.utils.data import BatchSampler, IterableDataset, IterDataPipe, RandomSampler, SequentialSampler
from torch.utils.data import default_collate, default_convert

from extsrc.engine import (AUTO_OUTPUTS, START_METHODS, EmptyEpochError, EpochSupersededError,
                           ForkedChildError, Hooks, InternalError, Order, ParallelSource, PoolClosedError,
                           RecordCache, SharedMemoryError, SourceTimeoutError, WorkerDiedError,
                           WorkerPool, is_async)
from extsrc.torch.loader import Device, LoopPosition, TorchLoader
from extsrc.torch.sampling import IndexTable, SampledBatches, draw_batches
from extsrc.torch.structure import Collation, Flattener, pack_whole, unpack_whole

_NUMERIC_KINDS = frozenset("biufc")

# DataLoader arguments from_dataset refuses, with what to do instead.
_NOT_MAPPED = {
    "pin_memory_device": "give device= ('cuda:N') for CUDA tensors, or pin_memory=True",
}

# The DataLoader attributes a from_dataset loader has, read-only once it is made (as DataLoader
# refuses to change some of them after its construction: its iterators read them).
DATALOADER_ATTRIBUTES = (
    "dataset", "batch_size", "drop_last", "sampler", "batch_sampler", "num_workers", "collate_fn",
    "pin_memory", "timeout", "worker_init_fn", "prefetch_factor", "persistent_workers",
    "generator", "in_order", "multiprocessing_context",
)
DEFAULT_PREFETCH_FACTOR = 2  # DataLoader's: batches prepared ahead per worker


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def draw_seed(generator: Optional[torch.Generator]) -> int:
    """A seed drawn as DataLoader draws its seeds: from ``generator``, else PyTorch's global
    generator (so that ``torch.manual_seed()`` decides it)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class WorkerStart:
    """Run once in each worker before its first sample, as a DataLoader worker starts: one
    PyTorch intra-op thread (a forked child does not have its parent's OpenMP threads, and its
    first parallel op would wait for them forever), the global generators of ``random``,
    NumPy and PyTorch seeded from ``base_seed`` and the worker's index, the worker's
    ``torch.utils.data.get_worker_info()``, then the user's ``worker_init_fn(worker_id)``."""

    def __init__(self, dataset: Any, base_seed: int, worker_init_fn: Optional[Callable[[int], None]]):
        self.dataset = dataset
        self.base_seed = base_seed
        self.worker_init_fn = worker_init_fn

    def __call__(self, worker_index: int, num_workers: int) -> None:
        from torch.utils.data._utils import worker as torch_worker

        torch.set_num_threads(1)
        seed = self.base_seed + worker_index  # as a DataLoader seeds its worker `worker_index`
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(np.random.SeedSequence([self.base_seed, worker_index]).generate_state(4))
        # What torch.utils.data.get_worker_info() returns in this process (PyTorch keeps it in
        # this module variable, set by its own workers likewise).
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=worker_index, num_workers=num_workers, seed=seed, dataset=self.dataset)
        if isinstance(self.dataset, IterDataPipe):  # as DataLoader shards a datapipe per worker
            from torch.utils.data import graph_settings

            graph_settings.apply_sharding(self.dataset, num_workers, worker_index)
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_index)


class DatasetSamples:
    """The callback run in the workers: ``dataset[info.record]``, flattened to arrays (its
    structure first, see :mod:`extsrc.torch.structure`)."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.flatten = Flattener()
        self._single = Flattener()(np.zeros(0), "")[0]  # the structure of one array

    def __call__(self, info: Any) -> Any:
        record = info.record
        try:
            sample = self.dataset[record]
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(extsrc.torch: raised by dataset[{record}])")
            raise
        if type(sample) is np.ndarray and sample.dtype.kind in _NUMERIC_KINDS:
            return self._single, sample  # the common case, first; the engine checks the rest
        return self.flatten(sample, f"dataset[{record}]")


class CollatedBatches:
    """The callback run in the workers with a user's ``collate_fn`` (or ``batch_size=None``):
    record ``b`` of the source's order is batch ``b`` of the epoch, made of the records at
    positions ``b * batch_size`` on of ``sample_order`` (each alone with ``batch_size=None``),
    collated by ``collate_fn`` here in the worker and written, as it came, into the batch's
    shared memory (:func:`~extsrc.torch.structure.pack_whole`)."""

    def __init__(self, dataset: Any, batch_size: Optional[int], collate_fn: Callable[[Any], Any],
                 sample_order: Order):
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.sample_order = sample_order
        self._records: Optional[RecordCache] = None  # made in the worker

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_records": None}

    def __call__(self, info: Any, buffers: Any) -> Any:
        if self._records is None:
            self._records = RecordCache(self.sample_order)
        epoch = info.epoch_idx
        if self.batch_size is None:
            index = self._records.get(epoch, info.record, info.record + 1)[0]
            samples: Any = self._fetch(index)
        else:
            start = info.record * self.batch_size
            stop = min(start + self.batch_size, len(self.sample_order))
            samples = [self._fetch(index) for index in self._records.get(epoch, start, stop)]
        batch = self.collate_fn(samples)
        return pack_whole(batch, buffers, f"collate_fn's batch {info.record}")

    def _fetch(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(extsrc.torch: raised by dataset[{index}])")
            raise


class AsyncDatasetSamples(DatasetSamples):
    """:class:`DatasetSamples` for a dataset with ``async def getitem_async(index)``: awaited on
    the worker's event loop, up to ``concurrency`` at once."""

    async def __call__(self, info: Any) -> Any:
        record = info.record
        try:
            sample = await self.dataset.getitem_async(record)
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(extsrc.torch: raised by dataset.getitem_async({record}))")
            raise
        if type(sample) is np.ndarray and sample.dtype.kind in _NUMERIC_KINDS:
            return self._single, sample
        return self.flatten(sample, f"dataset.getitem_async({record})")


def _start_method(context: Any, num_workers: int) -> str:
    """The start method a ``multiprocessing_context`` names, checked as a DataLoader checks it:
    ``ValueError`` for an unknown name or with ``num_workers=0``, ``TypeError`` for an object
    that is neither a name nor a multiprocessing context."""
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
        raise ValueError(
            f"multiprocessing_context option should specify a valid start method in "
            f"{START_METHODS} (or be a multiprocessing context of one), got {context!r}"
        )
    return method


class _DataLoaderAttributes:
    """DataLoader's attributes (:data:`DATALOADER_ATTRIBUTES`), read-only once described, and
    ``len()`` as DataLoader computes it."""

    _initialized = False
    # Set by _describe:
    _order: Optional[Order]
    dataset: Any
    batch_size: Optional[int]
    drop_last: bool
    batch_sampler: Any
    num_workers: int
    persistent_workers: bool
    generator: Optional["torch.Generator"]
    worker_init_fn: Optional[Callable[[int], None]]
    in_order: bool
    timeout: float
    _index_sampler: Any

    def _describe(self, attributes: dict, order: Optional[Order], index_sampler: Any = None) -> None:
        for name, value in attributes.items():
            self.__dict__[name] = value  # pin_memory too, beside a class's property
        object.__setattr__(self, "_order", order)
        object.__setattr__(self, "_index_sampler", index_sampler)  # a user's sampler drives it
        object.__setattr__(self, "_initialized", True)

    _loops_begun = 0

    def _begin_loop(self) -> Optional[int]:
        """Draws from ``generator`` what a DataLoader draws when a loop begins: a new base seed
        for the loop's workers (the first loop's was drawn when the loader was made; persistent
        workers keep theirs), so that a sampler sharing the generator gives the DataLoader's
        indices. The seed, or None when the workers of the last loop go on."""
        seed = None
        if self._loops_begun and not (self.persistent_workers and self.num_workers > 0):
            seed = draw_seed(self.generator)
        object.__setattr__(self, "_loops_begun", self._loops_begun + 1)
        return seed

    def _begin_sampled_loop(self) -> Any:
        """One loop's index sampler, after :meth:`_begin_loop`."""
        self._begin_loop()
        return self._index_sampler

    def __setattr__(self, name: str, value: Any) -> None:
        if self._initialized and name in DATALOADER_ATTRIBUTES:
            raise ValueError(f"{name} attribute should not be set after {type(self).__name__} is "
                             "initialized (it describes how the running workers load batches)")
        super().__setattr__(name, value)

    def __len__(self) -> int:
        """Batches per epoch, from ``len(dataset)`` now (as DataLoader's ``len()``); with
        ``shard=``, those of this shard; with a ``sampler``/``batch_sampler``, its ``len()``."""
        if self.__dict__.get("_index_sampler") is not None:
            return len(self._index_sampler)
        order = self._order
        records = len(order) if order is not None and order.shard[1] > 1 else len(self.dataset)
        if self.batch_size is None:
            return records
        return records // self.batch_size if self.drop_last else math.ceil(records / self.batch_size)


class InProcessLoader(_DataLoaderAttributes):
    """What :func:`from_dataset` returns for ``num_workers=0``: the dataset runs in this
    process, in the loop, as a DataLoader's does without workers (to debug a dataset: its
    breakpoints and prints are here). Each ``for`` loop is one epoch of the order; batches are
    those the workers would give. ``close()`` and ``with`` are accepted (nothing to stop)."""

    def __init__(self, dataset: Any, order: Optional[Order], batch_size: Optional[int], drop_last: bool,
                 collate: Optional[Callable[[Any], Any]]):
        self._dataset = dataset
        self._sample_order = order
        self._batch = batch_size
        self._drop = drop_last
        self._collate = collate  # None: as the workers collate (see _default_batch)
        self._flatten = Flattener()
        self._rebuild = Collation()
        self._next_epoch = 0
        self._closed = False

    def __iter__(self) -> Any:
        if self._closed:
            raise ValueError("this loader is closed")
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        resume, self._resume = self._resume, 0
        batches = self._batches(epoch)
        if resume:
            batches._next = resume
        self._loop = batches
        return batches

    _resume = 0  # the batch the next loop begins at (load_state_dict)
    _loop: Any = None  # the last loop begun

    def state_dict(self) -> dict:
        """Where the loader stands: the epoch and the next batch a loop would get (map-style
        dataset without a sampler only: an iterable or a sampler cannot be rewound)."""
        self._check_resumable("state_dict()")
        loop = self._loop
        if loop is not None and loop._next < loop._count:
            return {"epoch_idx": self._next_epoch - 1, "iteration": loop._next}
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
        if self._sample_order is None or self._index_sampler is not None:
            raise TypeError(f"{what} needs a map-style dataset without a sampler, batch_sampler or "
                            "generator: an iterable dataset or a sampler cannot be rewound")

    def _batches(self, epoch: int) -> Any:
        if self._index_sampler is not None:  # iterated as the loop goes, as DataLoader's
            return _SampledInProcessEpoch(self, iter(self._begin_sampled_loop()),
                                          self.batch_sampler is not None)
        if self._sample_order is None:  # an IterableDataset
            return self._iterated()
        return _InProcessEpoch(self, self._sample_order.epoch(epoch))

    def _batch_at(self, records: Any, k: int) -> Any:
        """Batch ``k`` of an epoch whose records are ``records``."""
        if self._batch is None:
            assert self._collate is not None, "from_dataset gives a collate without batch_size"
            return self._collate(self._dataset[int(records[k])])
        start = k * self._batch
        samples = [self._dataset[int(i)] for i in records[start:min(start + self._batch, len(records))]]
        return self._default_batch(samples) if self._collate is None else self._collate(samples)

    def _iterated(self) -> Any:
        samples = iter(self._dataset)
        if self._batch is None:
            assert self._collate is not None, "from_dataset gives a collate without batch_size"
            for sample in samples:
                yield self._collate(sample)
            return
        while True:
            batch = []
            for sample in samples:
                batch.append(sample)
                if len(batch) == self._batch:
                    break
            if not batch or (len(batch) < self._batch and self._drop):
                return
            yield self._default_batch(batch) if self._collate is None else self._collate(batch)
            if len(batch) < self._batch:
                return

    def _default_batch(self, samples: list) -> Any:
        """The samples collated as the workers' batches are (a field of ragged samples: a list)."""
        flat = [self._flatten(sample, f"dataset sample {k} of the batch") for k, sample in enumerate(samples)]
        outputs: list = []  # a tensor per field, or a list of them for a ragged field
        for column in zip(*flat):
            first = column[0]
            if all(a.shape == first.shape and a.dtype == first.dtype for a in column):
                outputs.append(torch.from_numpy(np.stack(column)))
            else:
                outputs.append([torch.from_numpy(np.array(a)) for a in column])
        return self._rebuild(tuple(outputs))

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> "InProcessLoader":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class _InProcessEpoch:
    """One loop of an :class:`InProcessLoader` over a map-style dataset. An error loading a
    batch is raised once, and the loop may go on with the next batch, as a DataLoader's."""

    def __init__(self, loader: InProcessLoader, records: Any):
        self._loader = loader
        self._records = records
        total = len(records)
        size = loader._batch
        self._count = total if size is None else total // size if loader._drop else -(-total // size)
        self._next = 0

    def __iter__(self) -> "_InProcessEpoch":
        return self

    def __next__(self) -> Any:
        k = self._next
        if k >= self._count:
            raise StopIteration
        self._next += 1  # first: a batch that raises is not tried again
        return self._loader._batch_at(self._records, k)


class _SampledInProcessEpoch:
    """One loop of an :class:`InProcessLoader` driven by a sampler: each batch of indices is
    drawn when its batch is asked for. An error loading a batch is raised once, and the loop
    may go on with the next batch, as a DataLoader's."""

    def __init__(self, loader: InProcessLoader, indices: Any, batched: bool):
        self._loader = loader
        self._indices = indices
        self._batched = batched

    def __iter__(self) -> "_SampledInProcessEpoch":
        return self

    def __next__(self) -> Any:
        indices = next(self._indices)
        dataset, collate = self._loader._dataset, self._loader._collate
        assert collate is not None, "from_dataset gives a collate_fn with a sampler"
        if self._batched:
            return collate([dataset[index] for index in indices])
        return collate(dataset[indices])


class DatasetLoader(_DataLoaderAttributes, TorchLoader):
    """What :func:`from_dataset` returns: a :class:`~extsrc.torch.TorchLoader` with a
    DataLoader's attributes (``dataset``, ``batch_size``, ``drop_last``, ``sampler``,
    ``batch_sampler``, ``num_workers``, ``collate_fn``, ``pin_memory``, ``timeout``,
    ``worker_init_fn``, ``prefetch_factor``, ``persistent_workers``, ``generator``,
    ``in_order``, ``multiprocessing_context``), read-only once it is made: setting one raises
    ``ValueError``, as DataLoader does. ``sampler`` and ``batch_sampler`` describe the order as
    a DataLoader's would (sequential or random); the records come from the loader's
    :class:`extsrc.Order`. ``len()`` is computed from ``len(dataset)`` when called, as
    DataLoader's."""

    @property
    def pin_memory(self) -> bool:
        """As given: with ``True`` and no CUDA, the loader warned and yields unpinned tensors."""
        return self.__dict__.get("pin_memory", self._pin)

    @pin_memory.setter
    def pin_memory(self, value: bool) -> None:
        self.__dict__["pin_memory"] = value  # reached only before _describe() ends

    _index_table: Optional[IndexTable] = None  # with a sampler: where the workers read indices
    # persistent_workers=False: makes the source of a loop's new workers, set up by the given
    # WorkerStart (whose base seed may be set until the source's workers start).
    _new_source: Optional[Callable[[WorkerStart], ParallelSource]] = None
    # A source made after the last loop's workers stopped (load_state_dict), not iterated yet.
    _fresh_start: Optional[WorkerStart] = None

    def _restart_with(self, new_source: Callable[[WorkerStart], ParallelSource]) -> None:
        """Makes each loop after the first run on new workers (``persistent_workers=False``):
        the last loop's source is closed and ``new_source(WorkerStart(...))`` made in its place,
        so that ``worker_init_fn`` runs again and the workers' copy of the dataset is fresh, as
        a DataLoader's workers are at each ``iter()``."""
        object.__setattr__(self, "_new_source", new_source)

    def _replace_source(self, base_seed: int, state: dict) -> WorkerStart:
        """Closes the current source and puts a new one in its place, at ``state``; the old one
        stays if anything (an interrupt included) stops this half-way."""
        assert self._new_source is not None, "only a loader without persistent workers renews them"
        old = self._source
        start = WorkerStart(self.dataset, base_seed, self.worker_init_fn)
        new = self._new_source(start)
        try:
            new.set_state(state)
            self._end_loop("a newer iter(loader)")
            object.__setattr__(self, "_source", new)
        except BaseException:
            object.__setattr__(self, "_source", old)
            new.close()
            raise
        object.__setattr__(self, "_stopped", False)
        old.close()  # batches of the last loop still held stay valid until dropped
        return start

    def _renew_workers(self, base_seed: Optional[int]) -> None:
        """With ``persistent_workers=False``, at the start of a loop after the first: the workers
        of the last loop stop, new ones load this loop, from where the old source stood."""
        if base_seed is None or self._new_source is None:
            return
        fresh = self._fresh_start
        if fresh is not None:  # made by load_state_dict, its workers not started yet
            fresh.base_seed = base_seed
            object.__setattr__(self, "_fresh_start", None)
            return
        position = self._position
        if position is not None and not position.finished:  # the last loop was left unfinished
            state = {"epoch_idx": self._source.next_epoch_idx, "iteration": 0}
        else:
            state = self._source.get_state()  # the next epoch, or where load_state_dict() put it
        self._replace_source(base_seed, state)

    _stopped = False  # the last loop's workers stopped at its end

    def _loop_finished(self, position: Any) -> None:
        """The loop at ``position`` ran to its end: if it is the loader's last loop, without
        persistent workers, they stop now, as a DataLoader's do at the end of its epoch (the
        next loop makes new ones; ``len()``, ``state_dict()`` still answer from the stopped
        source)."""
        if self._new_source is not None and position is self._position and self._fresh_start is None:
            self._source.close()
            object.__setattr__(self, "_stopped", True)

    def _drive_with(self, table: IndexTable) -> None:
        """Makes each loop draw its batches of indices from the loader's index sampler, here,
        and the workers read them from ``table`` (closed with the loader)."""
        object.__setattr__(self, "_index_table", table)

    def __iter__(self) -> Any:
        """Starts the next epoch; with a sampler, its indices are drawn now, in this process
        (as a DataLoader's iterator draws them), then the workers load them."""
        if self._closed:
            raise ValueError("this TorchLoader is closed")
        self._renew_workers(self._begin_loop())
        table = self._index_table
        if table is None:
            return _GoesOnAfterErrors(self, super().__iter__(), len(self._source))
        batches = draw_batches(self._index_sampler, self.batch_sampler is not None)
        if not batches:  # no batch this epoch: a DataLoader's loop ends at once
            self._end_loop("a newer iter(loader)")
            return iter(())
        table.write(self._source.next_epoch_idx, batches)
        return _GoesOnAfterErrors(self, super().__iter__(), len(batches))

    def state_dict(self) -> dict:
        """See :meth:`TorchLoader.state_dict`; ``TypeError`` with a sampler, batch_sampler or
        generator (a sampler's next epoch cannot be drawn again as it was)."""
        self._check_resumable("state_dict()")
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """See :meth:`TorchLoader.load_state_dict`; ``TypeError`` as :meth:`state_dict`."""
        self._check_resumable("load_state_dict()")
        if self._stopped and self._fresh_start is None:
            # The last loop's workers stopped: the next loop's source is made now, its workers
            # start (with the loop's base seed) at the next iter().
            start = self._replace_source(0, self._source.get_state())
            object.__setattr__(self, "_fresh_start", start)
        super().load_state_dict(state_dict)

    def _check_resumable(self, what: str) -> None:
        if self._index_table is not None:
            raise TypeError(f"{what} needs the loader's own order (no sampler, batch_sampler or "
                            "generator=): a sampler's epoch cannot be drawn again as it was")

    def close(self) -> None:
        """Stops the workers (see :meth:`TorchLoader.close`) and removes the sampler's indices."""
        super().close()
        if self._index_table is not None:
            self._index_table.close()


# Errors after which the workers are gone or the loop was ended: raised, and the loop ends.
# Any other error (what the dataset or collate_fn raised, a sample that cannot be collated)
# fails its batch alone, as in a DataLoader.
_ENDS_THE_LOOP = (WorkerDiedError, SourceTimeoutError, SharedMemoryError, PoolClosedError,
                  ForkedChildError, EpochSupersededError, InternalError)


def _in_dataloader_words(error: BaseException) -> None:
    """Puts the phrase a DataLoader's error for a dead worker or a timeout starts with before an
    engine error's message, for code written against DataLoader's messages. In place: the
    error keeps its type, attributes and traceback; worded once however often it is raised."""
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
    message = str(error)
    if not message.startswith(phrase):
        error.args = (phrase + message,)


class _GoesOnAfterErrors:
    """A loop over a :class:`DatasetLoader` that goes on after a batch fails, as a DataLoader's
    does: the error is raised at its batch, and the next ``next()`` gives the batch after it
    (the source's epoch is resumed there, at that position, with ``set_state``). ``count`` is
    the number of batches of the epoch."""

    def __init__(self, loader: "DatasetLoader", epoch: Any, count: int):
        self._loader = loader
        self._epoch = epoch
        self._count = count
        self._done = False
        self._failed: Any = None  # the loop whose batch failed, until the loop goes on after it
        self._plan: Optional[Tuple[str, Any]] = None  # what going on after it takes (decided once)

    def __iter__(self) -> "_GoesOnAfterErrors":
        return self

    def __len__(self) -> int:
        return self._count

    def __next__(self) -> Any:
        if self._failed is not None:  # going on after an error was interrupted: finish it
            self._go_on_after()
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
            _in_dataloader_words(exc)
            raise
        except Exception:
            self._failed = epoch  # first: an interrupt below leaves the next call to finish
            self._go_on_after()
            raise

    def _go_on_after(self) -> None:
        """Makes the loop go on after the batch of ``self._failed`` (a loop) that raised. What
        to do is decided once, from the loop as it failed; doing it is safe to run again when
        an interrupt cut it short."""
        if self._plan is None:
            self._plan = self._plan_after(self._failed)
        action, after = self._plan
        loader = self._loader
        if action == "resume":
            loader._source.set_state(after.state({}))
            self._epoch = TorchLoader.__iter__(loader)
        elif action == "done":
            self._done = True
            if after is not None:  # the last batch failed: the loop is over
                after.finished = True
                loader._loop_finished(after)
        self._plan = None
        self._failed = None

    def _plan_after(self, failed: Any) -> Tuple[str, Any]:
        """``("resume", position)``: the source's epoch ended with the error, and goes on from
        ``position`` (after the failed batch and those handed on before it: errors come in
        their place, also with in_order=False); ``("done", loop position or None)``; or
        ``("as is", None)``: the loop goes on by itself (the error was raised here, making
        tensors), or was ended, or the loader closed."""
        position, loader = failed.position, self._loader
        source = loader._source
        if position.ended_by is not None or loader._closed or failed.goes_on():
            return "as is", None
        if source.pool.broken or source.pool.closed:
            return "done", None  # the workers are gone (e.g. worker_init_fn failed)
        after = LoopPosition(position.epoch_idx, position.next_iteration, position.ahead)
        after.handed(position.next_iteration)
        if after.next_iteration >= self._count:
            return "done", position
        return "resume", after


class _HeapBuffers:
    """Room for a packed batch in the worker's own memory (batch mode has no shared-memory room
    before the engine writes what the callback returned)."""

    @staticmethod
    def array(nbytes: int, dtype: Any, output: int = 0) -> np.ndarray:
        return np.empty(nbytes, dtype)


def round_robin(iteration: int, num_workers: int) -> int:
    """DataLoader's order of workers: batch ``iteration`` of an epoch made whole by worker
    ``iteration % num_workers`` (``Hooks.assign``)."""
    return iteration % num_workers


class IterableBatches:
    """The source of one worker of an ``IterableDataset``: an iterable whose every pass iterates
    that worker's copy of the dataset (``get_worker_info().dataset``, the object
    ``worker_init_fn`` saw) and yields its batches as DataLoader forms them in a worker:
    ``batch_size`` samples (the last one shorter, or dropped with ``drop_last``), each batch
    flattened for the engine (default collation) or made by ``collate_fn`` and packed whole."""

    def __init__(self, batch_size: Optional[int], drop_last: bool,
                 collate_fn: Optional[Callable[[Any], Any]], seeds: Optional[IndexTable]):
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn  # None: default collation, in shared memory
        self.flatten = Flattener()
        self.seeds = seeds  # a datapipe's: each epoch's shuffle seed, written by the consumer
        self.epoch_seed: Optional[int] = None

    def begin_epoch(self, epoch_idx: int) -> None:
        """In the worker, before each pass (``Hooks.begin_epoch``): the seed the loader drew for
        this epoch at its ``iter()``."""
        if self.seeds is not None:
            self.epoch_seed = self.seeds.read(epoch_idx)[0]

    def __iter__(self) -> Any:
        from torch.utils.data import get_worker_info, graph_settings

        info = get_worker_info()
        assert info is not None, "iterated in a worker of the loader"
        dataset = info.dataset
        if isinstance(dataset, IterDataPipe) and self.epoch_seed is not None:
            # One seed per epoch for every worker, as DataLoader gives a datapipe: shuffled
            # alike in each worker, then sharded, every record comes once.
            rng = torch.Generator().manual_seed(self.epoch_seed)
            graph_settings.apply_random_seed(dataset, rng)
        samples = iter(dataset)
        size = 1 if self.batch_size is None else self.batch_size
        count = 0
        while True:
            batch = []
            for sample in samples:
                batch.append(sample)
                if len(batch) == size:
                    break
            if not batch or (len(batch) < size and self.drop_last):
                return
            where = f"batch {count} of this worker"
            count += 1
            if self.collate_fn is not None:
                made = self.collate_fn(batch[0] if self.batch_size is None else batch)
                description, buffer = pack_whole(made, _HeapBuffers, f"collate_fn's {where}")
                yield [description], [buffer]
                continue
            flat = [self.flatten(sample, f"sample {k} of {where}") for k, sample in enumerate(batch)]
            yield tuple(list(column) for column in zip(*flat))
            if len(batch) < size:
                return


class IterableLoader(_DataLoaderAttributes):
    """What :func:`from_dataset` returns for an ``IterableDataset`` with workers: each worker
    iterates its own copy of the dataset (shard it by ``get_worker_info()``, as with a
    DataLoader) and forms its batches; the loader yields them in DataLoader's order, one from
    each worker in turn, skipping workers that are done. Each ``for`` loop is one pass of every
    worker. ``close()`` (or ``with``) stops the workers."""

    def __init__(self, pool: Any, loaders: list, seeds: Optional[IndexTable]):
        self._pool = pool
        self._loaders = loaders  # one TorchLoader per worker, its source pinned to that worker
        self._seeds = seeds  # a datapipe's shuffle seed of each epoch, read by the workers
        self._closed = False  # close() began: iter() refuses
        self._closed_fully = False  # close() ran to its end
        self._len_asked: Optional[int] = None  # len(dataset) when len() was last asked

    def __len__(self) -> int:
        self._len_asked = len(self.dataset)
        return super().__len__()

    def __iter__(self) -> Any:
        if self._closed:
            raise ValueError("this loader is closed")
        if self._seeds is not None:
            # As DataLoader at each iter() of a datapipe: its shuffle seed for this epoch, the
            # same in every worker, drawn first (torch.manual_seed() before the loop decides it)
            # and published before any worker can begin the epoch.
            seed = draw_seed(self.generator)
            for epoch_idx in sorted({loader.source.next_epoch_idx for loader in self._loaders}):
                self._seeds.write(epoch_idx, [seed])
        self._begin_loop()  # then what a DataLoader draws for new workers (these persist)
        epochs = [iter(loader) for loader in self._loaders]  # ends the loops running before
        return _WorkerTurns(self, epochs)

    def close(self) -> None:
        if self._closed_fully:
            return
        # As TorchLoader.close: an interrupted close() is finished by the next one.
        self._closed = True
        for loader in self._loaders:
            loader.close()
        self._pool.close()
        if self._seeds is not None:
            self._seeds.close()
        self._closed_fully = True

    def __enter__(self) -> "IterableLoader":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class _WorkerTurns:
    """One loop of an :class:`IterableLoader`: the batches of its workers' loops (one per
    worker) in DataLoader's order, one from each worker in turn, skipping workers that are done;
    or with ``in_order=False`` from whichever worker has one first (waiting for the workers
    while none has). An iterator object, not a generator: an interrupt (KeyboardInterrupt)
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
            self._pass_turn(self._last)
        while self._active:
            epoch = self._next_turn()
            try:
                batch = epoch.__next__()
            except StopIteration:
                self._done(epoch)
                continue
            except (WorkerDiedError, SourceTimeoutError) as exc:
                _in_dataloader_words(exc)
                raise
            self._held = batch  # first: an interrupt below leaves it for the next call
            self._last = epoch
            self._yielded += 1
            self._warn_past_length()
            self._held = None
            return batch
        raise StopIteration

    def _pass_turn(self, epoch: Any) -> None:
        if epoch in self._active:
            self._turn = (self._active.index(epoch) + 1) % len(self._active)
        self._last = None

    def _done(self, epoch: Any) -> None:
        if epoch in self._active:
            index = self._active.index(epoch)
            self._active.remove(epoch)
            if index < self._turn:
                self._turn -= 1
            if self._turn >= len(self._active):
                self._turn = 0

    def _next_turn(self) -> Any:
        """The worker loop to take the next batch from (with ``in_order=False``, the first that
        has one, its end or an error; past the loader's ``timeout`` without any, the first,
        whose own wait raises the timeout naming what is stuck)."""
        loader = self._loader
        if loader.in_order:
            return self._active[self._turn]
        pool, waited = loader._pool, 0.0
        while True:
            with pool.lock:
                waiter = pool.waiter()  # taken before looking: a change after it releases it
            ready = next((epoch for epoch in self._active if epoch.ready()), None)
            if ready is not None:
                return ready
            if loader.timeout and waited >= loader.timeout:
                return self._active[0]
            started = time.monotonic()
            pool.wait(waiter, None if not loader.timeout else loader.timeout - waited)
            waited += time.monotonic() - started

    def _warn_past_length(self) -> None:
        loader = self._loader
        if loader._len_asked is not None and self._yielded > loader._len_asked:
            # As a DataLoader warns, and when: more batches than len(dataset) (each worker's
            # last batch may be short, so a count of len(loader) batches would warn for a
            # well-sharded dataset). The usual cause is workers that each yield the whole dataset.
            warnings.warn(
                f"Length of IterableDataset {loader.dataset!r} was reported to be "
                f"{loader._len_asked} (len(dataset), when len(loader) was asked), but "
                f"{self._yielded} samples have been fetched. For multiprocessing data-loading, this "
                f"usually means that each of the {loader.num_workers} workers iterates its own copy "
                "of the dataset: shard it by torch.utils.data.get_worker_info() (or in "
                "worker_init_fn) so that together they yield len(dataset) samples. (What is "
                "counted is what the loader yielded, as DataLoader counts: batches when "
                "batch_size is set.)", UserWarning, stacklevel=3)


def _iterable_loader(dataset: Any, batch_size: Optional[int], drop_last: bool, collate_fn: Any,
                     default: bool, num_workers: int, start_method: str, pickler: Any,
                     prefetch_factor: Optional[int], timeout: float, device: Device, pin_memory: bool,
                     worker_init: WorkerStart) -> IterableLoader:
    """The loader of an IterableDataset: a pool of ``num_workers``, one source pinned to each."""
    pool = WorkerPool(num_workers, start_method=start_method, pickler=pickler)
    seeds = IndexTable() if isinstance(dataset, IterDataPipe) else None
    loaders = []
    try:
        for worker in range(num_workers):
            source = ParallelSource(
                IterableBatches(batch_size, drop_last, None if default else collate_fn, seeds),
                batch_size if default and batch_size is not None else 1,  # default: it is
                batch=True,
                num_outputs=AUTO_OUTPUTS if default else 2,
                pool=pool,
                prefetch=prefetch_factor or DEFAULT_PREFETCH_FACTOR,
                last_batch="partial",
                timeout=timeout or None,
                name=f"from_dataset({type(dataset).__name__}), worker {worker}",
                # Once per worker (it sets the worker up for every source of the pool).
                hooks=Hooks(worker_init=worker_init if worker == 0 else None,
                            begin_epoch=IterableBatches.begin_epoch, dense_arrays=True),
            )
            loaders.append(TorchLoader._owning(source, device=device, pin_memory=pin_memory,
                                               rebuild=Collation() if default else unpack_whole))
    except BaseException:
        for loader in loaders:
            loader.close()
        pool.close()
        if seeds is not None:
            seeds.close()
        raise
    return IterableLoader(pool, loaders, seeds)


def _sampled_loader(dataset: Any, collate_fn: Callable[[Any], Any], batched: bool, index_sampler: Any,
                    attributes: dict, num_workers: int, start_method: str, pickler: Any,
                    prefetch_factor: Optional[int], timeout: float, concurrency: int, device: Any,
                    pin_memory: bool, worker_init: WorkerStart) -> DatasetLoader:
    """The loader of a map-style dataset driven by a sampler: one source batch per batch of
    indices, made by ``collate_fn`` in a worker (see :mod:`extsrc.torch.sampling`)."""
    if concurrency != 1:
        raise ValueError(f"concurrency={concurrency} needs the loader's own order (no sampler, "
                         "batch_sampler or generator=): a sampler's batches are made one at a time")
    table = IndexTable()

    def new_source(worker_start: WorkerStart) -> ParallelSource:
        return ParallelSource(
            SampledBatches(dataset, collate_fn, table, batched),
            1,
            num_outputs=2,
            in_place=True,
            num_workers=num_workers,
            start_method=start_method,
            pickler=pickler,
            prefetch=None if not isinstance(num_workers, int)
            else (prefetch_factor or DEFAULT_PREFETCH_FACTOR) * num_workers,
            last_batch="partial",
            timeout=timeout or None,
            name=f"from_dataset({type(dataset).__name__}, sampler)",
            hooks=Hooks(worker_init=worker_start, assign=round_robin, dense_arrays=True),
            in_order=attributes["in_order"],
        )

    try:
        source = new_source(worker_init)
    except BaseException:
        table.close()
        raise
    try:
        loader = DatasetLoader._owning(source, device=device,
                                       pin_memory=pin_memory and torch.cuda.is_available(),
                                       rebuild=unpack_whole)
    except BaseException:
        table.close()
        raise
    loader._drive_with(table)
    loader._describe(attributes, None, index_sampler)
    if not attributes["persistent_workers"] and _renewable(device, pin_memory):
        loader._restart_with(new_source)
    return loader


def _from_dataset(
    dataset: Any,
    batch_size: Optional[int] = 1,
    *,
    shuffle: Optional[bool] = None,
    sampler: Any = None,
    batch_sampler: Any = None,
    seed: int = 0,
    shard: Any = None,
    drop_last: bool = False,
    num_workers: int = 0,
    collate_fn: Optional[Callable[[Any], Any]] = None,
    generator: Optional[torch.Generator] = None,
    worker_init_fn: Optional[Callable[[int], None]] = None,
    multiprocessing_context: Any = None,
    prefetch_factor: Optional[int] = None,
    timeout: float = 0,
    persistent_workers: bool = False,
    in_order: bool = True,
    pin_memory: bool = False,
    device: Device = None,
    pickler: Any = None,
    concurrency: int = 1,
    **dataloader_kwargs: Any,
) -> Union[DatasetLoader, InProcessLoader, IterableLoader]:
    """A :class:`DatasetLoader` (a :class:`~extsrc.torch.TorchLoader`) over a map-style
    ``dataset``, in place of a DataLoader (an :class:`InProcessLoader` with ``num_workers=0``).

    ``dataset`` has ``__len__`` and ``__getitem__(index)``. Each batch is what
    DataLoader's default collation makes of the samples: a tensor per array,
    tensor or number field with the batch along dimension 0 (a field whose
    samples differ in shape gives a list of tensors instead of an error), a
    list of strings per string field, dicts, namedtuples and lists (for any
    other sequence) nested as in the sample. Nothing of the dataset runs in
    this process: the workers call ``dataset[index]``, and the layout of a
    sample is learnt from their first results.

    Arguments as DataLoader's: ``batch_size``, ``shuffle``, ``sampler``,
    ``batch_sampler``, ``generator``, ``drop_last``, ``collate_fn``,
    ``num_workers`` (0, the default as in DataLoader: in this process, in the loop),
    ``worker_init_fn(worker_id)`` (run in each worker before its first
    sample, where ``torch.utils.data.get_worker_info()`` gives the worker's
    ``id``, ``num_workers``, ``seed`` and ``dataset``),
    ``multiprocessing_context`` (``"fork"`` by default, ``"spawn"``,
    ``"forkserver"``, or such a context), ``prefetch_factor`` (batches per
    worker prepared ahead, default 2), ``timeout`` (seconds per batch, 0 for
    none; a late batch raises :class:`~extsrc.errors.SourceTimeoutError`, a
    ``RuntimeError`` as DataLoader's), ``pin_memory`` (the shared memory is
    page-locked once: no pinning copy; without CUDA a warning, as DataLoader
    gives), ``persistent_workers`` (``False``, the default: each loop after
    the first runs on new workers, with ``worker_init_fn`` run again, a fresh
    copy of the dataset and a new base seed; the workers persist anyway for
    an ``IterableDataset`` and with
    ``device=`` or ``pin_memory=True`` with CUDA); ``in_order=False`` (with
    workers: a batch that is finished comes before an earlier one that is
    not, so one slow batch holds back no other; each batch is still the one
    its indices make, and an error comes in its place; ``state_dict()``
    records the batches that came early). Batch ``i`` of each loop is made
    whole by worker ``i % num_workers``, as a DataLoader assigns them. Each worker uses one PyTorch thread and has its global generators
    seeded from a base seed drawn here and its index, as DataLoader's
    workers. An error loading a batch (in ``dataset[i]`` or ``collate_fn``)
    is raised at that batch, and the loop goes on with the next one, as
    DataLoader's.

    Without a ``sampler``, ``batch_sampler`` or ``generator``, the order is
    the loader's own :class:`extsrc.Order` (the fast path: the batches are
    collated in shared memory by the workers): ``seed`` (the shuffled order
    of each epoch is keyed by ``seed`` and the epoch) and ``shard``
    (``(rank, world_size)`` or ``"auto"`` from torchrun's environment;
    shards are padded to equal length, as DistributedSampler's). With one,
    the sampler is iterated in this process when each loop begins, as
    DataLoader's iterator does (a ``generator`` with ``shuffle=True`` gives
    ``RandomSampler``'s order, as DataLoader's; ``seed``/``shard`` are then
    refused), the workers load each batch of its indices and ``collate_fn``
    (``default_collate`` by default) makes the batch in the worker; an
    infinite sampler is not supported. Also ``device`` (CUDA tensors,
    copied on a side stream; see :class:`~extsrc.torch.TorchLoader`) and
    ``pickler`` (for spawn: see :class:`~extsrc.ParallelSource`), and
    ``concurrency``: samples in flight per worker, for a dataset that waits
    on storage: its ``__getitem__`` runs on that many threads per worker,
    or, if the dataset has ``async def getitem_async(index)``, that is
    awaited instead (default collation, no sampler).

    The workers start at the first loop, as a DataLoader's (with ``fork``,
    before CUDA is initialised, or use ``multiprocessing_context="spawn"``;
    ``device=``/``pin_memory=True`` with CUDA start them when the loader is
    made). Close the loader (``close()`` or ``with``) to stop its workers.
    Raises ``TypeError`` for DataLoader arguments that do not map here,
    saying what to use instead, and ``ValueError`` for the combinations
    DataLoader refuses; what the dataset raises, or a sample default
    collation cannot carry, is raised at its batch.
    """
    for name in dataloader_kwargs:
        if name in _NOT_MAPPED:
            raise TypeError(f"from_dataset does not take DataLoader's {name}=: {_NOT_MAPPED[name]}")
        raise TypeError(f"from_dataset() got an unexpected keyword argument {name!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers option should be non-negative: 0 loads in this process, "
                         f"N > 0 in N worker processes; got num_workers={num_workers!r}")
    iterable = isinstance(dataset, IterableDataset)
    if not iterable and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"from_dataset needs a map-style dataset (__len__ and __getitem__) or a "
            f"torch.utils.data.IterableDataset, got {type(dataset).__name__}"
        )
    if iterable and shuffle not in (None, False) and not isinstance(dataset, IterDataPipe):
        raise ValueError(f"DataLoader with IterableDataset: expected unspecified shuffle option, "
                         f"but got shuffle={shuffle}: each worker iterates its copy of the dataset")
    if iterable and (sampler is not None or batch_sampler is not None):
        given = "sampler" if sampler is not None else "batch_sampler"
        raise ValueError(f"DataLoader with IterableDataset: expected unspecified {given} option, "
                         f"but got {given}={sampler if sampler is not None else batch_sampler!r}: "
                         "each worker iterates its copy of the dataset")
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle: the sampler decides "
                         "the order; give shuffle=None")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, "
                             "sampler, and drop_last: the batch_sampler gives each batch's indices")
        batch_size, drop_last = None, False
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"collate_fn must be a callable or None, got {type(collate_fn).__name__}")
    if batch_size is None and drop_last and batch_sampler is None:
        raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive "
                         "with drop_last")
    shuffle = bool(shuffle) if shuffle is None else shuffle
    for name, value in (("shuffle", shuffle), ("drop_last", drop_last), ("pin_memory", pin_memory),
                        ("persistent_workers", persistent_workers), ("in_order", in_order)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError("prefetch_factor option could only be specified in multiprocessing: give "
                         "num_workers > 0, or prefetch_factor=None")
    if num_workers == 0 and persistent_workers:
        raise ValueError("persistent_workers option needs num_workers > 0")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"timeout option should be non-negative: seconds to wait for a batch "
                         f"(0: no limit), got timeout={timeout!r}")
    if prefetch_factor is not None and (isinstance(prefetch_factor, bool)
                                        or not isinstance(prefetch_factor, int) or prefetch_factor < 1):
        raise ValueError(f"prefetch_factor must be a positive int or None, got {prefetch_factor!r}")
    if worker_init_fn is not None and not callable(worker_init_fn):
        raise TypeError(f"worker_init_fn must be a callable or None, got {type(worker_init_fn).__name__}")
    start_method = _start_method(multiprocessing_context, num_workers)
    if isinstance(num_workers, int) and not isinstance(num_workers, bool) and num_workers > _usable_cpus():
        warnings.warn(
            f"from_dataset starts {num_workers} worker processes, and this process may use "
            f"{_usable_cpus()} CPUs: excessive worker creation might get DataLoader running slow "
            "or even freeze, and from_dataset alike (each worker also holds memory); give "
            "num_workers of at most the CPUs", UserWarning, stacklevel=2)
    if pin_memory and not torch.cuda.is_available():
        warnings.warn("pin_memory=True, and CUDA is not available here: the tensors are not pinned "
                      "(page-locked) memory", UserWarning, stacklevel=2)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    # As DataLoader draws its workers' base seed (from `generator` if given, else PyTorch's global
    # generator); with a generator and no seed=, the shuffled order is drawn from it too.
    base_seed = draw_seed(generator)
    # A user's sampler, or a shuffle drawn from a user's generator (RandomSampler's order, as
    # DataLoader's), is iterated in this process at each loop, and the workers get its indices.
    sampled = not iterable and (sampler is not None or batch_sampler is not None
                                or (bool(shuffle) and generator is not None))
    if sampled and (seed != 0 or shard is not None):
        raise ValueError(
            f"seed={seed!r} and shard={shard!r} decide the order of the loader's own extsrc.Order; "
            "with a sampler, batch_sampler or generator= the sampler decides it: give one or the other")
    if isinstance(dataset, IterDataPipe):  # DataLoader hands its shuffle setting to a datapipe
        from torch.utils.data import graph_settings

        dataset = graph_settings.apply_shuffle_settings(dataset, shuffle=bool(shuffle))
        shuffle = None
    order: Optional[Order] = None
    if not iterable and not sampled:
        records = len(dataset)
        if records == 0:
            raise ValueError("the dataset is empty (len(dataset) == 0)")
        order = Order(records, shuffle=bool(shuffle), seed=seed, shard=shard, remainder="pad")
    # The samples collated in shared memory (the fast path), or whole batches, each made by a
    # collate_fn in a worker: then the source's order is one of batches, one per source batch.
    default = collate_fn in (None, default_collate) and batch_size is not None and not sampled
    if batch_size is None and batch_sampler is None:
        collate_fn = default_convert if collate_fn is None else collate_fn
    else:
        collate_fn = default_collate if collate_fn is None else collate_fn
    if sampler is None and not iterable:
        sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
    if batch_sampler is None and batch_size is not None and not iterable:
        batch_sampler = BatchSampler(sampler, batch_size, drop_last)
    index_sampler = None
    if sampled:
        index_sampler = batch_sampler if batch_sampler is not None else sampler
    attributes = dict(
        dataset=dataset, batch_size=batch_size, drop_last=drop_last, sampler=sampler,
        batch_sampler=batch_sampler,
        num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory, timeout=timeout,
        worker_init_fn=worker_init_fn,
        prefetch_factor=None if num_workers == 0 else prefetch_factor or DEFAULT_PREFETCH_FACTOR,
        persistent_workers=persistent_workers, generator=generator, in_order=in_order,
        multiprocessing_context=multiprocessing_context,
    )
    if concurrency != 1 and (iterable or num_workers == 0):
        raise ValueError(
            f"concurrency={concurrency} needs a map-style dataset loaded by workers "
            f"(num_workers > 0); got {'an IterableDataset' if iterable else 'num_workers=0'}")
    if num_workers == 0:
        in_process = InProcessLoader(dataset, order, batch_size, drop_last,
                                     None if default else collate_fn)
        in_process._describe(attributes, order, index_sampler)
        return in_process
    if iterable:
        iterable_loader = _iterable_loader(
            dataset, batch_size, drop_last, collate_fn, default, num_workers, start_method, pickler,
            prefetch_factor, timeout, device, pin_memory and torch.cuda.is_available(),
            WorkerStart(dataset, base_seed, worker_init_fn))
        iterable_loader._describe(attributes, order)
        return iterable_loader
    if sampled:
        return _sampled_loader(dataset, collate_fn, batch_sampler is not None, index_sampler,
                               attributes, num_workers, start_method, pickler, prefetch_factor,
                               timeout, concurrency, device, pin_memory,
                               WorkerStart(dataset, base_seed, worker_init_fn))
    assert order is not None, "a map-style dataset has an order"
    if default:
        samples = AsyncDatasetSamples if is_async(getattr(dataset, "getitem_async", None)) else DatasetSamples
        callback: Any = samples(dataset)
        assert batch_size is not None, "the default collation needs a batch_size"
        source_order, source_batch = order, batch_size
    else:
        if concurrency != 1:
            raise ValueError(
                f"concurrency={concurrency} needs the default collation (collate_fn=None and a "
                "batch_size): a collate_fn makes whole batches in one call, one at a time")
        callback = CollatedBatches(dataset, batch_size, collate_fn, order)
        batches = len(order) if batch_size is None else (
            len(order) // batch_size if drop_last else math.ceil(len(order) / batch_size))
        if batches == 0:
            raise EmptyEpochError(
                f"{len(order)} records (this shard's, of len(dataset) == {records}) make no batch "
                f"of batch_size={batch_size} with drop_last=True; give drop_last=False or a "
                f"batch_size of at most {len(order)} (a DataLoader would yield no batch at all)")
        source_order, source_batch = Order(batches), 1
    def new_source(worker_start: WorkerStart) -> ParallelSource:
        return ParallelSource(
            callback,
            source_batch,
            num_outputs=AUTO_OUTPUTS if default else 2,
            in_place=not default,
            num_workers=num_workers,
            start_method=start_method,
            pickler=pickler,
            prefetch=None if not isinstance(num_workers, int)
            else (prefetch_factor or DEFAULT_PREFETCH_FACTOR) * num_workers,
            last_batch="drop" if drop_last else "partial",
            timeout=timeout or None,
            order=source_order,
            name=f"from_dataset({type(dataset).__name__})",
            concurrency=concurrency,
            hooks=Hooks(worker_init=worker_start, assign=round_robin, dense_arrays=True),
            in_order=in_order,
        )

    try:
        source = new_source(WorkerStart(dataset, base_seed, worker_init_fn))
    except EmptyEpochError:
        raise EmptyEpochError(
            f"{len(order)} records (this shard's, of len(dataset) == {records}) make no batch of "
            f"batch_size={batch_size} with drop_last=True; give drop_last=False or a batch_size "
            f"of at most {len(order)} (a DataLoader would yield no batch at all)"
        ) from None
    loader = DatasetLoader._owning(source, device=device,
                                   pin_memory=pin_memory and torch.cuda.is_available(),
                                   rebuild=Collation() if default else unpack_whole)
    loader._describe(attributes, order)
    if not persistent_workers and _renewable(device, pin_memory):
        loader._restart_with(new_source)
    return loader


class _DataLoaderLike:
    """:func:`from_dataset` itself: called as a DataLoader is, and subscripted as its class is
    in annotations (``DataLoader[Batch]`` is ``from_dataset[Batch]`` once only the import
    changes; the subscript gives ``from_dataset`` back)."""

    __call__ = staticmethod(_from_dataset)  # no frame of its own: warnings point at the caller

    def __getitem__(self, item: Any) -> "_DataLoaderLike":
        return self

    def __repr__(self) -> str:
        return "<function extsrc.torch.from_dataset>"


from_dataset = functools.update_wrapper(_DataLoaderLike(), _from_dataset)
from_dataset.__name__ = from_dataset.__qualname__ = "from_dataset"

def _renewable(device: Device, pin_memory: bool) -> bool:
    """Whether a loop's workers can be new ones (persistent_workers=False): not when the shared
    memory is made CUDA's (device=, pin_memory=True with CUDA), which is done once."""
    return device is None and not (pin_memory and torch.cuda.is_available())
