"""``from_dataset``: a map-style PyTorch ``Dataset`` run on the extsrc engine, as a DataLoader is.

``from_dataset(dataset, batch_size, shuffle=..., num_workers=..., ...)`` takes
the arguments of ``torch.utils.data.DataLoader`` that have a meaning here and
returns a :class:`~extsrc.torch.TorchLoader`: each epoch visits
``extsrc.Order(len(dataset), shuffle=..., seed=...)``, a worker calls
``dataset[info.record]`` for each sample and writes it (as NumPy) into shared
memory, and the loader gives the batch as tensors shaped as DataLoader's
default collation shapes them. The DataLoader arguments that do not map raise
``TypeError`` saying what to do instead.
"""

from __future__ import annotations

import collections.abc
import os
import random
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import IterableDataset

from extsrc.engine.source import ParallelSource
from extsrc.errors import EmptyEpochError
from extsrc.options import START_METHODS
from extsrc.order import Order
from extsrc.torch.loader import TorchLoader

# Kinds of sample, and what a batch of them becomes (as torch's default_collate makes it).
SINGLE, SEQUENCE, NAMEDTUPLE, MAPPING = "single", "sequence", "namedtuple", "mapping"

# DataLoader arguments from_dataset refuses, with what to do instead.
_NOT_MAPPED = {
    "sampler": "give shuffle=, seed= and shard= (an extsrc.Order decides the records of each epoch: "
               "shuffled by seed and epoch, shards as DistributedSampler's)",
    "batch_sampler": "give batch_size=, shuffle=, seed=, shard= and drop_last=",
    "collate_fn": "samples are collated in shared memory (one dense tensor per field when the "
                  "samples share shape and dtype, else a list of tensors); apply batch-level work "
                  "to the tensors the loader yields, or use extsrc.ParallelSource(batch=True)",
    "worker_init_fn": "set up per-worker state lazily in __getitem__ (on its first call in a "
                      "worker) or in the dataset's __setstate__ (spawn); the global random "
                      "generators are seeded per worker already",
    "generator": "give seed= (the shuffled order is keyed by seed and epoch)",
    "pin_memory_device": "give device= ('cuda:N') for CUDA tensors, or pin_memory=True",
}


_NUMERIC_KINDS = frozenset("biufc")


def _to_array(value: Any, record: int, field: str) -> np.ndarray:
    """One field of a sample as a NumPy array, as default_collate would make it a tensor."""
    if type(value) is np.ndarray and value.dtype.kind in _NUMERIC_KINDS:
        return value  # the common case, first
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(
                f"dataset[{record}]{field} is a tensor on {value.device}; __getitem__ must return "
                "CPU tensors (the workers are processes without CUDA)"
            )
        try:
            array = value.detach().resolve_conj().resolve_neg().numpy()
        except TypeError as exc:
            raise TypeError(
                f"dataset[{record}]{field} is a {value.dtype} tensor, which NumPy cannot hold "
                f"({exc}); return another dtype (e.g. tensor.float())"
            ) from None
    elif isinstance(value, (bool, np.bool_)):
        array = np.asarray(value, np.bool_)
    elif isinstance(value, int):
        array = np.asarray(value, np.int64)  # default_collate: a tensor of Python ints is int64
    elif isinstance(value, float):
        array = np.asarray(value, np.float64)  # and of Python floats float64
    elif isinstance(value, np.generic) or hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
        array = np.asarray(value)
    else:
        raise TypeError(
            f"dataset[{record}]{field} is a {type(value).__name__} ({value!r:.60}); from_dataset "
            "carries arrays, tensors and numbers (a DataLoader would pass strings and other "
            "objects through as lists): return numbers, or keep such fields out of the sample"
        )
    if array.dtype.kind not in _NUMERIC_KINDS:
        raise TypeError(
            f"dataset[{record}]{field} has dtype {array.dtype}; from_dataset carries numeric and "
            "bool arrays only"
        )
    return array


@dataclass(frozen=True)
class SampleLayout:
    """What one sample of the dataset holds: one field, a sequence, a namedtuple or a mapping."""

    kind: str
    keys: Tuple[Any, ...]  # mapping keys, namedtuple fields, or positions
    namedtuple: Any = None  # the namedtuple class

    @classmethod
    def of(cls, sample: Any) -> "SampleLayout":
        """The layout of ``sample`` (``dataset[0]``); ``TypeError`` for nested containers."""
        if isinstance(sample, collections.abc.Mapping):
            layout = cls(MAPPING, tuple(sample.keys()))
        elif isinstance(sample, tuple) and hasattr(sample, "_fields"):
            layout = cls(NAMEDTUPLE, tuple(sample._fields), type(sample))
        elif isinstance(sample, (tuple, list)):
            layout = cls(SEQUENCE, tuple(range(len(sample))))
        else:
            return cls(SINGLE, ())
        if not layout.keys:
            raise TypeError(f"dataset[0] is an empty {type(sample).__name__}; a sample needs a field")
        for key in layout.keys:
            value = sample[key] if layout.kind != NAMEDTUPLE else getattr(sample, key)
            if isinstance(value, (collections.abc.Mapping, tuple, list)):
                raise TypeError(
                    f"dataset[0][{key!r}] is a {type(value).__name__}: from_dataset takes samples "
                    "of one level (an array, or a tuple, list, namedtuple or dict of arrays); "
                    "flatten the nested fields"
                )
        return layout

    @property
    def num_outputs(self) -> Optional[int]:
        return None if self.kind == SINGLE else len(self.keys)

    def flatten(self, sample: Any, record: int) -> Any:
        """``dataset[record]`` as the engine takes it: an array, or a tuple of arrays."""
        if self.kind == SINGLE:
            return _to_array(sample, record, "")
        if self.kind == MAPPING:
            # By key, as default_collate: the order of a sample's keys does not matter.
            if not isinstance(sample, collections.abc.Mapping):
                raise TypeError(f"dataset[{record}] is a {type(sample).__name__}, and dataset[0] a "
                                f"mapping with the keys {list(self.keys)}")
            if len(sample) != len(self.keys) or any(k not in sample for k in self.keys):
                raise TypeError(f"dataset[{record}] holds the keys {list(sample.keys())}, and "
                                f"dataset[0] {list(self.keys)}")
            return tuple(_to_array(sample[k], record, f"[{k!r}]") for k in self.keys)
        if not isinstance(sample, (tuple, list)) or len(sample) != len(self.keys):
            what = f"{len(sample)} fields" if isinstance(sample, (tuple, list)) else type(sample).__name__
            raise TypeError(f"dataset[{record}] holds {what}, and dataset[0] {len(self.keys)} fields")
        return tuple(_to_array(value, record, f"[{k}]") for k, value in enumerate(sample))

    def rebuild(self, outputs: Any) -> Any:
        """A batch's tensors in the shape default_collate gives (a tuple sample gives a list)."""
        if self.kind == SINGLE:
            return outputs
        if self.kind == MAPPING:
            return dict(zip(self.keys, outputs))
        if self.kind == NAMEDTUPLE:
            return self.namedtuple(*outputs)
        return list(outputs)


class _ProcessSeeded:
    """Whether this process's global generators were seeded for a dataset (forked children
    start unseeded: they must not repeat their parent's or each other's draws)."""

    done = False

    @classmethod
    def forget(cls) -> None:
        cls.done = False


os.register_at_fork(after_in_child=_ProcessSeeded.forget)


class DatasetSamples:
    """The callback run in the workers: ``dataset[info.record]``, flattened to arrays.

    On its first call in each worker process it sets PyTorch to one intra-op
    thread (as DataLoader's workers do) and seeds the global generators
    of ``random``, NumPy and PyTorch from ``base_seed`` and the process id, so
    that workers draw different numbers, as in a DataLoader's workers.
    """

    def __init__(self, dataset: Any, layout: SampleLayout, base_seed: int):
        self.dataset = dataset
        self.layout = layout
        self.base_seed = base_seed

    def _set_up_process(self) -> None:
        # One intra-op thread, as in a DataLoader's workers: a forked child does not have the
        # parent's OpenMP threads, and its first parallel op would wait for them forever.
        torch.set_num_threads(1)
        seeds = np.random.SeedSequence([self.base_seed, os.getpid()]).generate_state(3)
        python_seed, numpy_seed, torch_seed = (int(s) for s in seeds)
        random.seed(python_seed)
        np.random.seed(numpy_seed)
        torch.manual_seed(torch_seed)
        _ProcessSeeded.done = True

    def __call__(self, info: Any) -> Any:
        if not _ProcessSeeded.done:
            self._set_up_process()
        record = info.record
        try:
            sample = self.dataset[record]
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(extsrc.torch: raised by dataset[{record}])")
            raise
        if type(sample) is np.ndarray and self.layout.kind == SINGLE:
            return sample  # the common case, first; the engine checks its dtype
        return self.layout.flatten(sample, record)


def _start_method(context: Any) -> str:
    if context is None:
        return "fork"
    method = context if isinstance(context, str) else getattr(context, "get_start_method", lambda: None)()
    if method not in START_METHODS:
        raise ValueError(
            f"multiprocessing_context must be one of {START_METHODS} or a multiprocessing context "
            f"of one of them, got {context!r}"
        )
    return method


def from_dataset(
    dataset: Any,
    batch_size: Optional[int] = 1,
    *,
    shuffle: bool = False,
    seed: int = 0,
    shard: Any = None,
    drop_last: bool = False,
    num_workers: int = 1,
    multiprocessing_context: Any = None,
    prefetch_factor: Optional[int] = None,
    timeout: float = 0,
    persistent_workers: bool = True,
    in_order: bool = True,
    pin_memory: bool = False,
    device: Any = None,
    pickler: Any = None,
    **dataloader_kwargs: Any,
) -> TorchLoader:
    """A :class:`~extsrc.torch.TorchLoader` over a map-style ``dataset``, in place of a DataLoader.

    ``dataset`` has ``__len__`` and ``__getitem__(index)`` returning an
    array, a tensor or a number, or a tuple, list, namedtuple or dict of
    them (one level). Each batch is shaped as DataLoader's default collation
    shapes it: one tensor per field with the batch along dimension 0 (a
    field whose samples differ in shape gives a list of tensors instead of
    an error), a tuple or list sample gives a list, a namedtuple a
    namedtuple, a dict a dict. ``dataset[0]`` is read once in this process to
    learn that layout.

    Arguments as DataLoader's: ``batch_size``, ``shuffle``, ``drop_last``,
    ``num_workers`` (at least 1: the dataset always runs in worker
    processes), ``multiprocessing_context`` (``"fork"`` by default,
    ``"spawn"``, ``"forkserver"``, or such a context), ``prefetch_factor``
    (batches per worker prepared ahead, default 2), ``timeout`` (seconds per
    batch, 0 for none), ``pin_memory`` (the shared memory is page-locked
    once: no pinning copy), ``persistent_workers`` and ``in_order`` (accepted:
    the workers always persist until ``close()``, and batches always come in
    order). Instead of a sampler: ``seed`` (the shuffled order of each epoch
    is keyed by ``seed`` and the epoch) and ``shard`` (``(rank, world_size)``
    or ``"auto"`` from torchrun's environment; shards are padded to equal
    length, as DistributedSampler's). Also ``device`` (CUDA tensors, copied
    on a side stream; see :class:`~extsrc.torch.TorchLoader`) and ``pickler``
    (for spawn: see :class:`~extsrc.ParallelSource`).

    The workers start here (a DataLoader starts them at the first loop): with
    ``fork``, make the loader before CUDA is initialised (before
    ``model.cuda()``), or use ``multiprocessing_context="spawn"``.
    ``len(loader)`` is the number of batches per epoch. Close the loader
    (``close()`` or ``with``) to stop its workers. Raises ``TypeError`` for
    DataLoader arguments that do not map here, saying what to use instead.
    """
    for name in dataloader_kwargs:
        if name in _NOT_MAPPED:
            raise TypeError(f"from_dataset does not take DataLoader's {name}=: {_NOT_MAPPED[name]}")
        raise TypeError(f"from_dataset() got an unexpected keyword argument {name!r}")
    if isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    ):
        raise TypeError(
            f"from_dataset needs a map-style dataset (__len__ and __getitem__), got "
            f"{type(dataset).__name__}; for an iterable, use extsrc.ParallelSource(generator_function, "
            "batch_size, batch=True)"
        )
    if batch_size is None:
        raise ValueError(
            "batch_size=None (DataLoader's unbatched mode) is not supported: from_dataset always "
            "makes batches; use batch_size=1 and take sample 0"
        )
    for name, value in (("shuffle", shuffle), ("drop_last", drop_last), ("pin_memory", pin_memory),
                        ("persistent_workers", persistent_workers), ("in_order", in_order)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if num_workers == 0:
        raise ValueError(
            "num_workers=0 runs a DataLoader's dataset in the main process; from_dataset always "
            "runs it in worker processes: give num_workers >= 1"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"timeout must be a number of seconds >= 0 (0: none), got {timeout!r}")
    if prefetch_factor is not None and (isinstance(prefetch_factor, bool)
                                        or not isinstance(prefetch_factor, int) or prefetch_factor < 1):
        raise ValueError(f"prefetch_factor must be a positive int or None, got {prefetch_factor!r}")
    start_method = _start_method(multiprocessing_context)
    records = len(dataset)
    if records == 0:
        raise ValueError("the dataset is empty (len(dataset) == 0)")
    first = dataset[0]
    layout = SampleLayout.of(first)
    layout.flatten(first, 0)  # a field that cannot be carried is an error here, not in a worker
    order = Order(records, shuffle=shuffle, seed=seed, shard=shard, remainder="pad")
    base_seed = int(torch.empty((), dtype=torch.int64).random_().item())  # as DataLoader draws it
    try:
        source = ParallelSource(
            DatasetSamples(dataset, layout, base_seed),
            batch_size,
            num_outputs=layout.num_outputs,
            num_workers=num_workers,
            start_method=start_method,
            pickler=pickler,
            prefetch=None if prefetch_factor is None or not isinstance(num_workers, int)
            else prefetch_factor * num_workers,
            last_batch="drop" if drop_last else "partial",
            timeout=timeout or None,
            order=order,
            name=f"from_dataset({type(dataset).__name__})",
        )
    except EmptyEpochError:
        raise EmptyEpochError(
            f"{len(order)} records (this shard's, of len(dataset) == {records}) make no batch of "
            f"batch_size={batch_size} with drop_last=True; give drop_last=False or a batch_size "
            f"of at most {len(order)} (a DataLoader would yield no batch at all)"
        ) from None
    try:
        source.start()  # now, so that a loader made before CUDA is initialised can fork
    except BaseException:
        source.close()
        raise
    return TorchLoader._owning(source, device=device, pin_memory=pin_memory, rebuild=layout.rebuild)
