"""Where a layer's loop over a source stands, to save and restore it mid-epoch."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Optional

from extsrc.engine.refill import Refill
from extsrc.engine.take import Cursor

if TYPE_CHECKING:
    from extsrc.engine.source import ParallelSource


class LoopPosition:
    """Where a layer's loop over a source stands: the epoch, and a :class:`~extsrc.engine.Cursor` of
    the batches handed on (the next one, and later ones handed on already, ``in_order=False``).
    ``after(n)``, where given, is the source's state after ``n`` batches of the epoch (a source
    with ``on_error="skip"`` counts batches its own way; see :mod:`extsrc.engine.refill`)."""

    __slots__ = ("epoch_idx", "cursor", "finished", "ended_by", "after")

    def __init__(self, epoch_idx: int, next_iteration: int, ahead: Iterable[int] = (),
                 after: Optional[Callable[[int], Dict[str, Any]]] = None):
        self.epoch_idx = epoch_idx
        self.cursor = Cursor(next_iteration, ahead)
        self.finished = False
        self.ended_by: Optional[str] = None  # what ended the loop before its epoch's end
        self.after = after

    @classmethod
    def of(cls, source: "ParallelSource", batches: Any, start: Dict[str, Any]) -> "LoopPosition":
        """The position of a loop over ``batches``, the source's epoch begun at ``start``."""
        if isinstance(batches, Refill):
            return cls(start["epoch_idx"], batches.resumed_at,
                       after=functools.partial(source.refill_state, batches))
        return cls(start["epoch_idx"], start["iteration"], start.get("handed_out", ()))

    def handed(self, iteration: int) -> None:
        """Batch ``iteration`` was handed on; idempotent (for a batch an interrupt made the loop
        hand on again)."""
        self.cursor.hand(iteration)

    def state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """``state`` (the source's) at this position."""
        if self.after is not None:
            return self.after(self.cursor.next)
        state = {**state, "epoch_idx": self.epoch_idx, "iteration": self.cursor.next}
        state.pop("handed_out", None)
        handed_out = self.cursor.handed_out()
        if handed_out:
            state["handed_out"] = handed_out
        return state
