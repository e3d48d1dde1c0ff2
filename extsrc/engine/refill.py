"""Full batches when ``on_error="skip"`` leaves samples out: the refill.

A batch whose callback skipped a sample comes from the producer one sample
short. :class:`Refill` sits between the epoch (:class:`~extsrc.engine.take.Epoch`)
and the consumer and hands out batches of ``batch_size`` made of the good
samples in epoch order: the missing sample is taken from the next batch,
whose missing first sample from the one after it, and so on. Until the first
skip a batch is handed out as it came (zero-copy, dense); after it, a batch
spans two of the producer's batches: a list of zero-copy views of the one
it takes most samples from, and copies of the others' (so that each batch
a loop holds keeps one producer's batch in shared memory, not two).

The end of the epoch follows ``last_batch``: ``"drop"`` drops the good
samples left that do not fill a batch, ``"partial"`` hands them out, and
``"pad"`` fills the last batch with repeats of its own samples and adds
batches of repeats of the last one until the epoch has ``len(source)``
batches, so that every rank of a distributed job takes as many batches
whatever it skipped.

Position: a batch handed out is made of *pieces* (the unused good samples of
the producer's batches taken so far). :meth:`Refill.position` says where the
consumer stands in the producer's terms: the producer's batches of the
pieces are not handed out yet, and ``carry`` names those of them whose first
good samples were (iteration -> how many). A resumed run takes the same
batches again and drops those samples, so that it goes on with the same
records, provided the callback fails on the same records again.

Interrupts, as in :mod:`extsrc.engine.take`: every change is one store (a
producer's batch that arrived, the state after a batch was made, the batch
handed over), so an exception arriving at any line loses and repeats nothing.
Threads: one batch at a time is made, under the refill's lock; the hand-over
is the swap of :attr:`Refill._ready`, which gives a batch to one thread.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from extsrc.batch import Batch
from extsrc.engine.assembly import BatchOutput, Output
from extsrc.errors import CallbackError, EmptyEpochError

if TYPE_CHECKING:  # pragma: no cover
    from extsrc.engine.take import Epoch


class Piece(NamedTuple):
    """The good samples ``start..`` of the producer's batch ``iteration``."""
    iteration: int
    start: int
    outcome: BatchOutput


class RefillState(NamedTuple):
    """What the refill holds between two batches (replaced whole, never changed)."""
    pieces: Tuple[Piece, ...] = ()
    given: int = 0  # batches handed out in this epoch, before the resume too
    ended: bool = False  # the producer's epoch ended
    done: bool = False  # so did this one: what is left makes no batch
    last: Optional[BatchOutput] = None  # the last batch handed out (kept for "pad" only)
    data_given: int = 0  # batches handed out before the last one of data (not of repeats)


class RefillPosition(NamedTuple):
    """Where a refilled epoch stands, after some of its batches, in the producer's batches."""
    iteration: int  # the first producer's batch not all handed out
    handed_out: Tuple[int, ...]  # later ones that were (in_order=False)
    carry: Tuple[Tuple[int, int], ...]  # (producer's batch, its good samples handed out)
    faults: int  # samples of the producer's batches handed out that were skipped
    given: int  # the refill's batches handed out
    discard: int = 0  # batches a resume makes again and drops (to repeat them, "pad")


# Positions a refill remembers, of the batches handed out last: a layer that runs ahead (CUDA
# copies) asks for the position a batch or two back.
_MARKS_KEPT = 8


class Refill:
    """The consumer's iterator of an epoch of a source with ``on_error="skip"``.

    Caller: the consumer's threads, as an epoch. Owner: the source, which
    makes one per epoch (``iter()``, the pool's lock held) and asks it for
    :meth:`position`. ``faults(besides)`` counts the epoch's faults but those of
    the producer's batches ``besides`` (the pool's lock held).
    """

    def __init__(self, epoch: "Epoch", batch_size: int, last_batch: str, batches: Optional[int],
                 faults: Callable[[Iterable[int]], int],
                 carry: Optional[Dict[int, int]] = None, given: int = 0, discard: int = 0):
        self.epoch = epoch
        self.epoch_idx = epoch.epoch_idx
        self.batch_size = batch_size
        self.last_batch = last_batch
        self.batches = batches  # len(source) with an order: what "pad" fills up to
        self._faults = faults
        self._drop = dict(carry or {})  # producer's batch -> good samples a resume drops of it
        self._state = RefillState(given=given)
        self._arrival: Optional[BatchOutput] = None  # a producer's batch not yet a piece
        # Made, not handed over yet: the batch, and the state before it.
        self._ready: Optional[Tuple[BatchOutput, RefillState]] = None
        # "pad": the position after the batches made, and before the last one of data.
        self._true = self._data_mark = self._mark(self._state)
        self._discard = discard  # batches to make again and drop (a resume in the pad tail)
        # The batches handed out before this run, those it makes again and drops counted in.
        self.resumed_at = given + discard
        resumed = self._true._replace(discard=discard)
        self._marks: Dict[int, RefillPosition] = {given: resumed, self.resumed_at: resumed}
        self.last_given = self.resumed_at - 1  # the number of the batch handed out last, from 0
        self._lock = threading.Lock()

    def __iter__(self) -> "Refill":
        return self

    def __next__(self) -> BatchOutput:
        while True:
            with self._lock:
                if self._ready is None:
                    self._make()
            # The hand-over: no call from the swap to the return (see the module doc).
            ready = self._ready
            self._ready = None
            if ready is not None:
                self.last_given = ready[1].given
                return ready[0]

    def goes_on(self) -> bool:
        """Whether ``__next__()`` may still give batches."""
        state = self._state
        if self._ready is not None:
            return True
        return not state.done and (state.ended or self.epoch.goes_on())

    def ready(self) -> bool:
        """Whether ``__next__()`` would return or raise at once rather than wait."""
        state = self._state
        return (self._ready is not None or state.ended or self._arrival is not None
                or _count(state.pieces) >= self.batch_size or self.epoch.ready())

    def position(self, given: Optional[int] = None) -> RefillPosition:
        """Where the epoch stands after ``given`` of its batches (default: those handed out;
        one of the last few, for a layer that runs ahead)."""
        ready = self._ready
        handed = max((self._state if ready is None else ready[1]).given, self.resumed_at)
        mark = self._marks.get(handed if given is None else given)
        if mark is None or (given is not None and given > handed):
            raise ValueError(f"the position after {given} batches of epoch {self.epoch_idx} is "
                             f"not known: {handed} were handed out, and the last "
                             f"{_MARKS_KEPT} positions are kept")
        return mark

    def _mark(self, state: RefillState) -> RefillPosition:
        """The position once the batches of ``state`` are handed out (takes the pool's lock)."""
        held = {p.iteration for p in state.pieces}
        with self.epoch.taker.pool.lock:
            first, later = self.epoch.position()
            start = min([first, *held])
            handed = (set(later) | set(range(start, first))) - held
            faults = self._faults(held)  # the batches taken and not handed out are those held
        carry = {p.iteration: p.start for p in state.pieces if p.start}
        carry.update({i: n for i, n in self._drop.items()
                      if i >= start and i not in held and i not in handed})
        return RefillPosition(start, tuple(sorted(handed)), tuple(sorted(carry.items())), faults,
                              state.given)

    # -- making a batch (the refill's lock held) ---------------------------------------------

    def _make(self) -> None:
        """Makes the next batch and commits it to :attr:`_ready` (those a resume in the pad
        tail discards are made and dropped); raises what the producer's ``next()`` raises."""
        while True:
            state = self._fill()
            made = self._cut(state)
            if made is None:
                self._state = state._replace(done=True, last=None)
                raise StopIteration
            after = made[1]
            if self.last_batch != "pad":
                self._marks[after.given] = self._mark(after)
            else:  # a resume makes the last batch of data again: the batches of repeats need it
                if after.data_given == state.given:  # a batch of data
                    self._data_mark, self._true = self._true, self._mark(after)
                self._marks[after.given] = self._data_mark._replace(
                    discard=after.given - after.data_given)
            self._marks.pop(after.given - _MARKS_KEPT, None)
            if self._discard:
                self._state, self._discard = after, self._discard - 1  # two stores, no call
                continue
            self._ready, self._state = (made[0], state), after  # two stores, no call between
            return

    def _fill(self) -> RefillState:
        """Takes the producer's batches until one of ours is full or the epoch ends."""
        while True:
            if self._arrival is not None:
                self._settle()
            state = self._state
            if _count(state.pieces) >= self.batch_size or state.ended:
                return state
            try:
                self._arrival = self.epoch.__next__()  # one store: the batch is the refill's
            except StopIteration:
                self._state = state._replace(ended=True)
            except BaseException:
                if self.epoch.goes_on():  # a batch's error, in its place: the position is past it
                    self._marks[state.given] = self._mark(state)
                raise

    def _settle(self) -> None:
        """The arrived batch becomes a piece (less what a resume drops of it)."""
        arrival, state = self._arrival, self._state
        assert arrival is not None
        iteration = self.epoch.last_given
        start = self._drop.get(iteration, 0)
        pieces = state.pieces
        if _size(arrival) > start:
            pieces = pieces + (Piece(iteration, start, arrival),)
        self._state, self._arrival = state._replace(pieces=pieces), None  # one store each, no call

    def _cut(self, state: RefillState) -> Optional[Tuple[BatchOutput, RefillState]]:
        """The next batch and the state after it, or None at the end of the epoch."""
        size, have = self.batch_size, _count(state.pieces)
        if have >= size:
            return self._take(state, size)
        if have and self.last_batch == "partial":
            return self._take(state, have)
        if self.last_batch == "pad" and self._pads_left(state) > 0:
            if have:
                outcome, after = self._take(state, have)
                full = _repeated(outcome, size)
                return full, after._replace(last=full)
            if state.last is not None:
                return state.last, state._replace(given=state.given + 1)
        if not state.given and not have:
            self._all_failed()
        if have and self.last_batch == "drop" and not state.given:
            raise EmptyEpochError(
                f"epoch {self.epoch_idx} has {have} good samples left after on_error='skip', "
                f"fewer than batch_size={size}, and last_batch='drop' dropped them all, so the "
                "epoch has no batch. Use last_batch='partial' or 'pad', or a smaller batch_size.")
        return None

    def _all_failed(self) -> None:
        """Raises when the epoch's every sample was skipped: a bug (a path, a decoder), not
        bad data, which an empty epoch would hide."""
        failed = self._faults(())
        if failed:
            raise CallbackError(
                f"every sample of epoch {self.epoch_idx} failed and was skipped "
                f"(on_error='skip', {failed} of them), so the epoch has no batch; the source's "
                "faults() lists them (what raised, and where)")

    def _take(self, state: RefillState, n: int) -> Tuple[BatchOutput, RefillState]:
        """The first ``n`` good samples of the pieces, and the state without them."""
        parts: List[BatchOutput] = []
        pieces = list(state.pieces)
        while n:
            piece = pieces[0]
            left = _size(piece.outcome) - piece.start
            used = min(n, left)
            parts.append(_cut(piece.outcome, piece.start, piece.start + used))
            n -= used
            if used == left:
                pieces.pop(0)
            else:
                pieces[0] = piece._replace(start=piece.start + used)
        outcome = parts[0] if len(parts) == 1 else _joined(parts)
        last = outcome if self.last_batch == "pad" else None  # held for "pad" only: it holds memory
        return outcome, state._replace(pieces=tuple(pieces), given=state.given + 1, last=last,
                                       data_given=state.given)

    def _pads_left(self, state: RefillState) -> int:
        if self.last_batch != "pad" or self.batches is None:
            return 0
        return self.batches - state.given


def _outputs(outcome: BatchOutput) -> Sequence[Output]:
    return outcome if isinstance(outcome, tuple) else (outcome,)


def _size(outcome: BatchOutput) -> int:
    outputs = _outputs(outcome)
    return len(outputs[0]) if outputs else 0


def _count(pieces: Tuple[Piece, ...]) -> int:
    return sum(_size(p.outcome) - p.start for p in pieces)


def _cut(outcome: BatchOutput, start: int, stop: int) -> BatchOutput:
    """Samples ``start..stop-1`` of each output (the outcome itself when that is all of it)."""
    if start == 0 and stop == _size(outcome):
        return outcome
    cut = [_cut_output(o, start, stop) for o in _outputs(outcome)]
    return tuple(cut) if isinstance(outcome, tuple) else cut[0]


def _cut_output(output: Output, start: int, stop: int) -> Output:
    if isinstance(output, Batch):
        return Batch(dense=output.as_array()[start:stop]) if output.is_dense \
            else Batch(output[start:stop])
    return output[start:stop]


def _joined(parts: List[BatchOutput]) -> BatchOutput:
    """One batch of the parts' samples, in order. The largest part stays views of its shared
    memory; the samples of the others are copied, so that a batch holds one producer's batch
    in memory, as an unrefilled one does (a loop holding n batches holds n, not 2n). Outputs
    that are arrays (``dense_arrays``) stay one array where the samples share shape and dtype
    (concatenated: a copy), else become a Batch."""
    kept = max(range(len(parts)), key=lambda k: _size(parts[k]))
    columns = list(zip(*(_outputs(p) for p in parts)))
    joined: List[Output] = []
    for column in columns:
        # A list, not a generator: all() stopping early would leave a generator whose close,
        # later, a Ctrl-C could land in and be lost ("Exception ignored in").
        if all([isinstance(o, np.ndarray) for o in column]) and len(
                {(o.shape[1:], o.dtype) for o in column}) == 1:
            joined.append(np.concatenate(column, dtype=column[0].dtype))  # its byte order kept
            continue
        joined.append(Batch([sample if k == kept else np.array(sample)
                             for k, o in enumerate(column) for sample in o]))
    return tuple(joined) if isinstance(parts[0], tuple) else joined[0]


def _repeated(outcome: BatchOutput, size: int) -> BatchOutput:
    """``outcome`` filled up to ``size`` samples with repeats of its own, from its first."""
    have = _size(outcome)
    index = [k % have for k in range(size)]
    filled: List[Output] = []
    for output in _outputs(outcome):
        if isinstance(output, Batch):
            filled.append(Batch([output[k] for k in index]))
        else:
            filled.append(output[index])
    return tuple(filled) if isinstance(outcome, tuple) else filled[0]
