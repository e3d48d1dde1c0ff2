"""``from_dataset``: a PyTorch ``Dataset`` run on the extsrc engine, as a DataLoader runs it.

It translates DataLoader's arguments (:mod:`extsrc.torch.arguments`), picks the plan for the
kind of dataset (:mod:`extsrc.torch.plans`) and returns the plan's loader
(:mod:`extsrc.torch.loaders`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch

from extsrc.torch.arguments import Loading
from extsrc.torch.loader import Device
from extsrc.torch.loaders import DatasetLoader, InProcessLoader, IterableLoader
from extsrc.torch.plans import plan_for


def _from_dataset(
    dataset: Any, batch_size: Optional[int] = 1, *, shuffle: Optional[bool] = None, sampler: Any = None,
    batch_sampler: Any = None, seed: int = 0, shard: Any = None, drop_last: bool = False,
    num_workers: int = 0, collate_fn: Optional[Callable[[Any], Any]] = None,
    generator: Optional[torch.Generator] = None, worker_init_fn: Optional[Callable[[int], None]] = None,
    multiprocessing_context: Any = None, prefetch_factor: Optional[int] = None, timeout: float = 0,
    persistent_workers: bool = False, in_order: bool = True, pin_memory: bool = False,
    device: Device = None, pickler: Any = None, concurrency: int = 1, worker_restarts: int = 0,
    on_error: Any = "raise", max_errors: Union[None, int, float] = None, **dataloader_kwargs: Any,
) -> Union[InProcessLoader, DatasetLoader, IterableLoader]:
    """A loader over ``dataset`` in place of ``torch.utils.data.DataLoader(dataset, ...)``: an
    :class:`InProcessLoader` (``num_workers=0``), a :class:`DatasetLoader` (map-style) or an
    :class:`IterableLoader`, each with DataLoader's attributes (read-only) and ``len()``.

    ``dataset`` is map-style (``__len__`` and ``__getitem__``) or an
    ``IterableDataset``. DataLoader's arguments keep their meaning (see
    ``docs/pytorch.md``): ``batch_size``, ``shuffle``, ``sampler``,
    ``batch_sampler``, ``generator``, ``drop_last``, ``collate_fn``,
    ``num_workers`` (0, the default: in this process, in the loop),
    ``worker_init_fn``, ``multiprocessing_context`` (``"fork"`` by default),
    ``prefetch_factor``, ``timeout`` (a late batch raises a ``RuntimeError``),
    ``pin_memory`` (the shared memory is page-locked once),
    ``persistent_workers`` (``False``: each loop after the first on new
    workers, but for an IterableDataset or CUDA's shared memory) and
    ``in_order``. Batch ``i`` of a loop is made whole by worker
    ``i % num_workers``; an error loading a batch is raised at that batch and
    the loop goes on, as DataLoader's.

    Without a sampler, batch_sampler or generator, the order is the loader's
    own :class:`extsrc.Order` (``seed``, ``shard=(rank, world_size)`` or
    ``"auto"``), and with the default collation the workers collate each
    batch in shared memory (a field whose samples differ in shape gives a
    list of tensors). Also ``device`` (CUDA tensors, see
    :class:`~extsrc.torch.TorchLoader`), ``pickler`` (for spawn), and
    ``concurrency``: samples in flight per worker (``__getitem__`` on threads,
    or an ``async def getitem_async(index)`` awaited); ``worker_restarts``:
    how many lost workers are replaced, their batches redone, before a loss
    raises (default 0: as DataLoader, a lost worker ends the loop);
    ``on_error`` and ``max_errors`` (default collation, own order): a sample
    whose ``__getitem__`` raises is skipped (its batch refilled from the next) or
    replaced (see :class:`extsrc.ParallelSource`; ``loader.source.faults()``
    lists them).

    The workers start at the first loop; ``close()`` (or ``with``) stops them.
    ``state_dict()``/``load_state_dict()`` resume a map-style dataset in the
    loader's own order. DataLoader arguments that do not map raise
    ``TypeError`` saying what to use instead; the combinations DataLoader
    refuses raise ``ValueError``, with DataLoader's phrases.
    """
    args = Loading(
        dataset=dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
        seed=seed, shard=shard, drop_last=drop_last, num_workers=num_workers, collate_fn=collate_fn,
        generator=generator, worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
        prefetch_factor=prefetch_factor, timeout=timeout, persistent_workers=persistent_workers,
        in_order=in_order, pin_memory=pin_memory, device=device, pickler=pickler, concurrency=concurrency,
        worker_restarts=worker_restarts, on_error=on_error, max_errors=max_errors,
        unknown=dataloader_kwargs)
    return plan_for(args).loader()


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
