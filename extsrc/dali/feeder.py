"""The callback DALI calls for a parallel external source: batches of the engine, in DALI's order.

DALI gets an ordinary (non-parallel) batch external source whose callback is
a :class:`Feeder`. DALI calls it once per iteration with ``BatchInfo(iteration,
epoch_idx)``, in the thread that runs the pipeline; the feeder takes the next
batch of the engine's epoch and hands it over without copying (one dense array
when the batch is dense, else the list of sample arrays). DALI's iteration and
epoch numbers are the only truth about *which* batch is wanted: when they are
not the next batch of the engine's running epoch (first call, ``reset()``, a
restored checkpoint, an epoch cut short by another source), the feeder moves
the engine there with ``set_state()``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, List, Optional, Union

import numpy as np

from extsrc.engine import Batch, ExhaustedIteratorError, ParallelSource, describe_dtype

CYCLE_OFF = "no"
CYCLE_RAISE = "raise"
CYCLE_QUIET = "quiet"
CALLER = "extsrc.fn.external_source"  # how the drop-in's errors name it


def cycle_mode(cycle: Any) -> str:
    if cycle is None or cycle is False or cycle == "no":
        return CYCLE_OFF
    if cycle is True or cycle == "quiet":
        return CYCLE_QUIET
    if cycle == "raise":
        return CYCLE_RAISE
    raise ValueError(
        f'cycle must be "no" (or False/None), "quiet" (or True) or "raise"; got {cycle!r}'
    )


def _misread(dtype: np.dtype) -> Optional[str]:
    """What DALI makes of samples of ``dtype`` when it would read other numbers (DALI takes the
    bytes without a word: complex64 as twice as many float32, big-endian float64 1.0 as native
    3.0e-319), with the fix; None when it reads them right."""
    if dtype.kind not in "biuf" or dtype.itemsize > 8:  # > 8: np.longdouble
        return (f"dtype {dtype}, which DALI has no type for (it takes bool, integer and floating-"
                "point arrays of up to 64 bits, and would read these bytes as other numbers or "
                "fail); convert them in the callback, e.g. np.stack([x.real, x.imag], -1) for "
                "complex samples, x.astype(np.float64) for long doubles")
    if not dtype.isnative:  # named against the native dtype: "float64 (big-endian, '>f8')"
        return (f"dtype {describe_dtype(dtype, dtype.newbyteorder('='))}, which DALI reads in this "
                "machine's byte order, as other numbers; convert them in the callback: "
                "x.astype(x.dtype.newbyteorder('='))")
    return None


def check_fed(fed: Union[np.ndarray, List[np.ndarray]], output: int, caller: str) -> None:
    """Raises TypeError when DALI would misread ``fed`` (one output of a batch, a dense array or
    a list of samples), where DALI would give other numbers without an error. One check for
    an array; for a list, one per dtype met (about 35 ns a sample)."""
    if isinstance(fed, np.ndarray):
        why = _misread(fed.dtype)
        if why is not None:
            raise TypeError(f"{caller}: output {output} has samples of {why}")
        return
    fit = None  # the last dtype found fit: a batch's samples mostly share one dtype object
    for k, sample in enumerate(fed):
        dtype = sample.dtype
        if dtype is fit:
            continue
        why = _misread(dtype)
        if why is not None:
            raise TypeError(f"{caller}: output {output}, sample {k} of the batch, has {why}")
        fit = dtype


def _to_dali(samples: Union[Batch, np.ndarray], output: int) -> Union[np.ndarray, List[np.ndarray]]:
    """What DALI is fed for one output: the dense array (a view), else the list of views."""
    if isinstance(samples, np.ndarray):  # the source's dense_arrays=True
        fed: Union[np.ndarray, List[np.ndarray]] = samples
    elif samples.is_dense:
        fed = samples.as_array()
    else:
        fed = list(samples)
    check_fed(fed, output, CALLER)
    return fed


class Feeder:
    """The callback DALI calls (non-parallel, batch mode, ``batch_info=True``).

    Keeps the engine's epoch in step with DALI's ``BatchInfo`` and a reference
    to the last ``keep`` batches it handed to DALI, so that the memory behind
    a zero-copy feed stays mapped for as long as the engine keeps it unchanged.
    """

    def __init__(self, source: ParallelSource, callable_source: bool, cycle: str, keep: int, original: Any,
                 name: Optional[str] = None):
        self.source = source
        self.name = name  # the user's name=, for reader_meta(name) (DALI's iterators' reader_name=)
        self.cycle = cycle
        self.original = original
        self.callable_source = callable_source
        self._epoch: Any = None  # iterator of the engine's running epoch
        self._expected: Optional[tuple] = None  # (epoch_idx, iteration) it will yield next
        self._exhausted = False  # cycle "no" over an iterable: ended for good
        self._kept: Deque[Any] = deque(maxlen=keep)
        self._handed: Optional[tuple] = None  # (DALI's position, batch) of the last batch handed

    def __repr__(self) -> str:
        return f"extsrc parallel source {self.original!r}"

    def __call__(self, info: Any) -> Any:
        """``info``: DALI's ``BatchInfo`` of the batch it wants now."""
        position = (info.epoch_idx, info.iteration)
        if self._exhausted:
            raise StopIteration
        handed = self._handed
        if handed is not None and handed[0] == position:
            # DALI asks again for the batch this feeder handed it last: an exception (an
            # interrupt) reached DALI after this call returned and before DALI counted the
            # iteration. The same batch again: the next one would skip it (an iterable cannot
            # rewind), and a callable would be made again for nothing.
            batch = handed[1]
        else:
            batch = self._take(position)
        if self.source.num_outputs is None:
            return _to_dali(batch, 0)
        return tuple(_to_dali(samples, j) for j, samples in enumerate(batch))

    def _take(self, position: tuple) -> Any:
        """The engine's batch for DALI's ``position``, kept for DALI (and for a repeated ask)."""
        # A callable follows DALI's numbers. An iterable or generator is one stream, as in DALI:
        # a reset() caused by another source's end does not rewind it (it goes on where it
        # was); only its own end starts its next pass (see _after_end).
        if self._epoch is None or (self.callable_source and position != self._expected):
            self._restart(position)
        try:
            batch = self._epoch.__next__()  # not next(): see extsrc.engine.take
        except (StopIteration, ExhaustedIteratorError):
            # An iterator that did not start a new pass when iterated again gives DALI an empty
            # epoch (as DALI's own parallel source does), not an error.
            batch = self._after_end(position)
        except Exception:
            if self._epoch.goes_on():  # a batch's error, in its place: the epoch goes on after it
                self._expected = (position[0], position[1] + 1)
            else:
                self._epoch, self._expected = None, None  # next call resumes at DALI's position
            raise
        # No call between the take and this store: an interrupt lands before the take (the
        # engine's epoch keeps the batch, extsrc.engine.take) or after the batch is recorded.
        self._handed = (position, batch)
        self._expected = (position[0], position[1] + 1)
        self._kept.append(batch)
        return batch

    def _restart(self, position: tuple) -> None:
        epoch_idx, iteration = position
        if not self.callable_source:
            iteration = 0  # an iterator cannot be rewound: it restarts (DALI warns at definition)
        if self.source.spec.on_error == "skip" and iteration:
            self._replay(epoch_idx, iteration)
            return
        self.source.set_state({"epoch_idx": epoch_idx, "iteration": iteration})
        self._epoch = iter(self.source)

    def _replay(self, epoch_idx: int, iteration: int) -> None:
        """DALI's batch ``iteration`` of an epoch whose skipped samples moved the samples after
        them up (on_error="skip"): which records it holds depends on the skips before it, which
        DALI's checkpoint does not keep, so the epoch is made again from its start up to it."""
        self.source.set_state({"epoch_idx": epoch_idx, "iteration": 0})
        self._epoch = iter(self.source)
        for _ in range(iteration):
            try:
                self._epoch.__next__()
            except (StopIteration, ExhaustedIteratorError):
                return  # the epoch ends before DALI's batch: its next() says so

    def _after_end(self, position: tuple) -> Any:
        epoch_idx = position[0]
        if self.cycle == CYCLE_QUIET:
            # Rewind at once, invisibly to DALI: the next engine epoch continues this one.
            self._epoch = iter(self.source)
            try:
                return self._epoch.__next__()
            except (StopIteration, ExhaustedIteratorError):
                self._epoch, self._expected = None, None
                raise StopIteration from None
        self._epoch, self._expected = None, None
        if self.cycle == CYCLE_OFF and not self.callable_source:
            self._exhausted = True
            raise StopIteration
        # Start producing DALI's next epoch now: reset() will ask for (epoch + 1, 0).
        try:
            self.source.set_state({"epoch_idx": epoch_idx + 1, "iteration": 0})
            self._epoch = iter(self.source)
            self._expected = (epoch_idx + 1, 0)
        except Exception:
            self._epoch, self._expected = None, None  # the error comes back at the next call
        raise StopIteration

    def release(self) -> None:
        """Drops the references to fed batches (after DALI stopped reading them)."""
        self._kept.clear()
        self._handed = None
        self._epoch, self._expected = None, None
