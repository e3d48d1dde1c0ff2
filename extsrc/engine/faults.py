"""What a source does with a sample its callback fails on: ``on_error=`` and ``max_errors=``.

``on_error="raise"`` (the default) fails the sample's batch: its error is
raised in the batch's place, and the epoch goes on (see docs/engine.md).
``on_error="skip"`` drops the sample: its batch comes from the workers
without it, one sample shorter, and the source's refill
(:mod:`extsrc.engine.refill`) fills it up from the next batch. A
callable ``on_error(info, error)`` runs in the worker and returns the
sample to use in its place (what it raises fails the batch, as the
callback's error would). Only what the callback raises counts, never a
sample that fails its checks (a wrong dtype is a bug, not bad data);
``StopIteration`` still ends the epoch.

Every skipped or replaced sample is a :class:`SampleFault`, listed by
``ParallelSource.faults()`` (where to find the bad record) and counted in
``stats()``. ``max_errors``, a count or a fraction of the epoch's samples,
is the budget of an epoch: the batch past it raises
:class:`~extsrc.errors.TooManyErrorsError`, listing the epoch's faults.

Who calls what: :func:`guarded` in the worker, around the callback (its
faults go back with the task's answer); :class:`FaultLedger` in the
consumer's ``next()``, under the pool's lock, as batches are taken.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

from extsrc.checks import is_int
from extsrc.engine import policy
from extsrc.errors import ExtsrcError, TooManyErrorsError
from extsrc.sample_info import BatchInfo, SampleInfo

# on_error(info, error) -> the sample (or, in batch mode, the batch) to use instead
Replace = Callable[[Any, Exception], Any]
OnError = Union[str, Replace]
ON_ERROR_POLICIES = ("raise", "skip")
_MESSAGE_CHARS = 300


class SampleFault(NamedTuple):
    """A sample the callback failed on, skipped or replaced (``replaced``)."""

    epoch_idx: int
    iteration: int
    idx_in_batch: int
    idx_in_epoch: int
    record: int  # what the callback was asked to load (idx_in_epoch without an order)
    type_name: str
    message: str
    replaced: bool

    def __str__(self) -> str:
        what = "replaced" if self.replaced else "skipped"
        return (f"record {self.record} (epoch {self.epoch_idx}, batch {self.iteration}, "
                f"sample {self.idx_in_batch}) {what}: {self.type_name}: {self.message}")


class _Skipped:
    """What a guarded callback returns for a skipped sample: written nowhere."""

    def __repr__(self) -> str:
        return "<skipped sample>"

    def __reduce__(self) -> str:
        return "SKIPPED"


SKIPPED = _Skipped()


def check_on_error(on_error: object, max_errors: object, epoch_samples: Optional[int]) -> None:
    """``ValueError``/``TypeError`` saying what is wrong with the two arguments."""
    if not callable(on_error) and on_error not in ON_ERROR_POLICIES:
        raise ValueError(f"on_error must be one of {ON_ERROR_POLICIES} or a callable "
                         f"(info, error) -> sample, got {on_error!r}")
    if max_errors is None:
        return
    if on_error == "raise":
        raise ValueError("max_errors= is the budget of errors on_error='skip' or a replacing "
                         "callable lets pass; with on_error='raise' every error raises")
    if is_int(max_errors):
        if max_errors < 0:  # type: ignore[operator]
            raise ValueError(f"max_errors must be a count >= 0 or a fraction in (0, 1), got {max_errors!r}")
        return
    if not isinstance(max_errors, float) or not 0.0 < max_errors < 1.0:
        raise ValueError(f"max_errors must be a count >= 0 or a fraction in (0, 1), got {max_errors!r}")
    if epoch_samples is None:
        raise ValueError(f"max_errors={max_errors} is a fraction of the epoch's samples, which only "
                         "an order= knows; give a count instead")


def budget(max_errors: Union[None, int, float], epoch_samples: Optional[int]) -> Optional[int]:
    """The faults an epoch may have (``None``: any number)."""
    if max_errors is None or is_int(max_errors):
        return max_errors  # type: ignore[return-value]  # an int here
    assert epoch_samples is not None, "checked by check_on_error"
    return int(max_errors * epoch_samples)


def guarded(callback: Callable[..., Any], on_error: OnError, faults: List[SampleFault],
            is_async: bool) -> Callable[..., Any]:
    """``callback`` with its errors handled by ``on_error`` ("skip" or a callable); each
    handled error is appended to ``faults``. Worker side."""

    def handle(info: Union[SampleInfo, BatchInfo], exc: Exception) -> Any:
        replaced = on_error != "skip"
        value = SKIPPED if not replaced else on_error(info, exc)  # type: ignore[operator]
        faults.append(fault_of(info, exc, replaced))
        return value

    if is_async:
        async def call_async(info: Any, *rest: Any) -> Any:
            try:
                return await callback(info, *rest)
            except (StopIteration, ExtsrcError):
                raise
            except Exception as exc:
                if _ends_epoch(exc):
                    raise
                return handle(info, exc)
        return functools.wraps(callback)(call_async)

    def call(info: Any, *rest: Any) -> Any:
        try:
            return callback(info, *rest)
        except (StopIteration, ExtsrcError):  # the epoch's end; extsrc's own (checks, memory)
            raise
        except Exception as exc:
            if _ends_epoch(exc):
                raise
            return handle(info, exc)
    return call


def _ends_epoch(exc: Exception) -> bool:
    """Whether ``exc`` is a coroutine's ``StopIteration`` (Python turns it into this
    ``RuntimeError``): the end of the epoch, as in a plain callback."""
    return isinstance(exc, RuntimeError) and isinstance(exc.__cause__, StopIteration)


def fault_of(info: Union[SampleInfo, BatchInfo], exc: BaseException, replaced: bool) -> SampleFault:
    message = str(exc)
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS] + "..."
    if isinstance(info, SampleInfo):
        return SampleFault(info.epoch_idx, info.iteration, info.idx_in_batch, info.idx_in_epoch,
                           info.record, type(exc).__qualname__, message, replaced)
    return SampleFault(info.epoch_idx, info.iteration, -1, -1, -1, type(exc).__qualname__, message,
                       replaced)


def faults_of_task(faults: List[SampleFault], epoch_idx: int, iteration: int, start: int,
                   stop: int) -> Tuple[SampleFault, ...]:
    """Takes out of ``faults`` (in place) those of a task's samples ``start..stop-1``."""
    if not faults:
        return ()
    mine = tuple(f for f in faults if f.epoch_idx == epoch_idx and f.iteration == iteration
                 and (f.idx_in_batch < 0 or start <= f.idx_in_batch < stop))
    if mine:
        faults[:] = [f for f in faults if f not in mine]
    return mine


class FaultLedger:
    """The consumer's account of a source's faults: every one counted, the newest
    :data:`~extsrc.engine.policy.FAULTS_LISTED` kept, the epoch's against its budget. Lock
    held (the pool's)."""

    def __init__(self, name: str, limit: Optional[int]):
        self.name = name
        self.limit = limit
        self.listed: Deque[SampleFault] = deque(maxlen=policy.FAULTS_LISTED)
        self.skipped = 0
        self.replaced = 0
        self.epoch: Dict[int, List[SampleFault]] = {}  # epoch_idx -> its faults (the current one)
        self._seen: Dict[int, int] = {}  # the newest batch seqs counted -> faults (a batch counts once)
        self._per_batch: Dict[int, Dict[int, int]] = {}  # epoch_idx -> iteration -> its faults

    def resume(self, epoch_idx: int, count: int) -> None:
        """A resumed epoch starts with the ``count`` faults its state recorded."""
        self.epoch = {epoch_idx: [_UNLISTED] * count}
        self._per_batch = {}

    def count(self, epoch_idx: int, besides: Iterable[int] = ()) -> int:
        """Faults of the epoch, but those of its batches ``besides`` (taken from the workers,
        not handed out yet: a resume takes them again)."""
        count = len(self.epoch.get(epoch_idx, ()))
        per_batch = self._per_batch.get(epoch_idx, {})
        return count - sum(per_batch.get(iteration, 0) for iteration in besides)

    def taken(self, seq: int, epoch_idx: int, faults: Tuple[SampleFault, ...]) -> Optional[TooManyErrorsError]:
        """Counts the faults of batch ``seq`` (once however often it is taken); the error to
        raise in its place when the epoch's budget is spent."""
        if not faults:
            return None
        if seq not in self._seen:
            self._seen[seq] = len(faults)
            if len(self._seen) > policy.FAULTS_COUNTED_WINDOW:
                self._seen.pop(next(iter(self._seen)))
            if epoch_idx not in self.epoch:
                self.epoch = {epoch_idx: []}
                self._per_batch = {}
            self.epoch[epoch_idx].extend(faults)
            per_batch = self._per_batch.setdefault(epoch_idx, {})
            for f in faults:
                per_batch[f.iteration] = per_batch.get(f.iteration, 0) + 1
            self.listed.extend(faults)
            for f in faults:
                if f.replaced:
                    self.replaced += 1
                else:
                    self.skipped += 1
        epoch = self.epoch.get(epoch_idx, [])
        if self.limit is None or len(epoch) <= self.limit:
            return None
        shown = [f for f in epoch if f is not _UNLISTED]
        lines = "\n".join(f"  {f}" for f in shown[-50:])
        more = len(epoch) - min(len(shown), 50)
        return TooManyErrorsError(
            f"source {self.name}: {len(epoch)} samples of epoch {epoch_idx} failed, more than "
            f"max_errors={self.limit}:\n{lines}" + (f"\n  ... and {more} more" if more else ""),
            faults=tuple(shown))


_UNLISTED = SampleFault(-1, -1, -1, -1, -1, "", "(before the resume)", False)
