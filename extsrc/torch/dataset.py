"""``from_dataset``: a PyTorch ``Dataset`` run on the extsrc engine, as a DataLoader runs it.

It translates DataLoader's arguments (:mod:`extsrc.torch.arguments`) and returns the loader
for the kind of dataset (:mod:`extsrc.torch.plans`, :mod:`extsrc.torch.loaders`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch

from extsrc.torch.arguments import Loading
from extsrc.torch.loader import Device
from extsrc.torch.loaders import InProcessLoader, IterableLoader
from extsrc.torch.plans import DatasetLoader, loader_for


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
    """A loader over ``dataset`` (map-style or an ``IterableDataset``) in place of
    ``torch.utils.data.DataLoader(dataset, ...)``, with DataLoader's attributes and ``len()``.

    DataLoader's arguments keep their meaning (``multiprocessing_context`` is ``"fork"`` by default);
    extsrc's own: ``seed`` and ``shard`` (the loader's :class:`extsrc.Order` without a sampler or
    generator), ``device``, ``pickler``, ``concurrency``, ``worker_restarts``, ``on_error`` and
    ``max_errors`` (see :class:`extsrc.ParallelSource`). The workers start at the first loop; ``close()``
    (or ``with``) stops them. Arguments that do not map raise ``TypeError``; what DataLoader refuses,
    ``ValueError`` in DataLoader's words. See ``docs/pytorch.md``.
    """
    given = dict(locals())  # the arguments (first: before any other local name is bound)
    unknown = given.pop("dataloader_kwargs")
    return loader_for(Loading(**given, unknown=unknown))


class _DataLoaderLike:
    """:func:`from_dataset` itself: called as a DataLoader is, and subscripted as its class is in
    annotations (``DataLoader[Batch]`` becomes ``from_dataset[Batch]``: ``from_dataset`` again)."""

    __call__ = staticmethod(_from_dataset)  # no frame of its own: warnings point at the caller

    def __getitem__(self, item: Any) -> "_DataLoaderLike":
        return self

    def __repr__(self) -> str:
        return "<function extsrc.torch.from_dataset>"


from_dataset = functools.update_wrapper(_DataLoaderLike(), _from_dataset)
from_dataset.__name__ = from_dataset.__qualname__ = "from_dataset"
