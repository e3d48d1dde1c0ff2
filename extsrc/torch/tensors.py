"""Torch tensors over a batch's shared memory, without a copy, and walking nested results."""

from __future__ import annotations

from typing import Any, Callable, List, Union

import numpy as np
import torch

from extsrc.engine import Batch, describe_dtype

Tensors = Union[torch.Tensor, List[torch.Tensor]]


def output_tensors(samples: Union[Batch, np.ndarray], output: int = 0) -> Tensors:
    """One output of a batch: one tensor (dense), else a list of per-sample tensors (ragged),
    views of the batch's shared memory; ``TypeError`` for a dtype PyTorch has no tensor type
    for, or of the other byte order."""
    try:
        if isinstance(samples, np.ndarray):  # a dense output of a source with dense_arrays=True
            return torch.from_numpy(samples)
        if samples.is_dense:
            return torch.from_numpy(samples.as_array())
        return [torch.from_numpy(sample) for sample in samples]
    except (TypeError, ValueError) as exc:  # ValueError: the byte order
        raise _untensored(samples, output, exc) from None


def _untensored(samples: Union[Batch, np.ndarray], output: int, exc: Exception) -> TypeError:
    """The error for an output ``torch.from_numpy`` refused with ``exc``."""
    where = f"output {output} of the batch"
    if isinstance(samples, np.ndarray) or samples.is_dense or not samples:
        dtype = samples.dtype if isinstance(samples, np.ndarray) else samples[0].dtype if samples else None
    else:  # ragged: the first sample of another byte order, else the first
        k = next((k for k, s in enumerate(samples) if not s.dtype.isnative), 0)
        where, dtype = f"{where}, sample {k},", samples[k].dtype
    if dtype is not None and not dtype.isnative:  # named against the native dtype
        return TypeError(f"{where} has dtype {describe_dtype(dtype, dtype.newbyteorder('='))}, and "
                         "PyTorch's tensors are in this machine's byte order only; convert it where "
                         "it is made (the callback, a Dataset's __getitem__): "
                         "x.astype(x.dtype.newbyteorder('='))")
    return TypeError(f"{where} has dtype {dtype}, which PyTorch cannot view as a tensor ({exc}); "
                     "return another dtype from the callback")


def batch_tensors(batch: Any) -> Any:
    """A source's batch (a :class:`~extsrc.Batch`, or a tuple of them) as tensors, per output."""
    if isinstance(batch, tuple):
        return tuple(output_tensors(samples, j) for j, samples in enumerate(batch))
    return output_tensors(batch)


def map_tensors(function: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``function`` applied to every tensor in it (tuples, lists, dicts, namedtuples)."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(function, v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(function, v) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(function, v) for k, v in value.items()}
    return value


def each_tensor(value: Any) -> List[torch.Tensor]:
    """Every tensor in ``value`` (see :func:`map_tensors`)."""
    found: List[torch.Tensor] = []
    map_tensors(found.append, value)
    return found
