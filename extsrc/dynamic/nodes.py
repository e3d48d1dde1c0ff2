"""torchdata nodes over a parallel ``extsrc.dynamic.ExternalSource``, with exact resume.

DALI's dynamic-mode nodes (``ndd.pytorch.nodes.Reader``) yield a dict of a
reader's outputs per batch and refuse ``reset(initial_state)``: its readers
cannot checkpoint there. :class:`ExternalSource` is the same kind of node
over a parallel source, and its ``get_state()`` / ``reset(initial_state)``
resume exactly where the state was taken, so that a ``torchdata.nodes.Loader``
over it (``state_dict()`` / ``load_state_dict()``) does. Importing this
module imports torchdata (and PyTorch).
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional, Sequence, Tuple

import torchdata.nodes as tn

from extsrc.dynamic.external_source import ExternalSource as ParallelExternalSource

__all__ = ["ExternalSource"]


class ExternalSource(tn.BaseNode[Dict[str, Any]]):
    """Each ``next()`` is the source's next batch as ``{name: ndd.Batch}``; ``StopIteration``
    ends an epoch, and ``reset()`` (a ``Loader``'s new epoch) begins the next one.

    ``source``: an ``extsrc.dynamic.ExternalSource`` made with ``parallel=True``;
    ``output_names``: one per output (default ``("data",)`` for one output, ``("data",
    "label")`` for two, as DALI's nodes name a reader's).
    """

    def __init__(self, source: ParallelExternalSource, output_names: Optional[Sequence[str]] = None):
        super().__init__()
        if not isinstance(source, ParallelExternalSource) or not hasattr(source, "parallel_source"):
            raise TypeError("extsrc.dynamic.nodes.ExternalSource needs an extsrc.dynamic.ExternalSource "
                            f"made with parallel=True, got {source!r}")
        outputs = source._num_outputs  # DALI's own attribute: the count given to the source
        names = _default_names(outputs) if output_names is None else tuple(output_names)
        if len(names) != outputs:
            raise ValueError(f"output_names: the source has {outputs} output(s), got {len(names)} "
                             f"name(s) {names!r}")
        self._source = source
        self._names = names
        self._started = False  # a batch was taken since the last reset

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        """To the state of :meth:`get_state`, or (None) to the start of the next epoch: the
        epoch under way is left where it stands."""
        super().reset(initial_state)
        if initial_state is not None:
            self._source.set_state(initial_state["source"])
        elif self._started:
            position = json.loads(self._source.get_state())
            if position["iteration"] > 0 or "refill" in position or "handed_out" in position:
                # Mid-epoch: the next one from its start.
                fresh = {k: v for k, v in position.items()
                         if k not in ("faults", "handed_out", "refill")}
                self._source.set_state({**fresh, "epoch_idx": position["epoch_idx"] + 1,
                                        "iteration": 0, "records": 0})
        self._started = False

    def next(self) -> Dict[str, Any]:
        outputs = self._source()
        self._started = True
        batches: Tuple[Any, ...] = outputs if isinstance(outputs, tuple) else (outputs,)
        return dict(zip(self._names, batches))

    def get_state(self) -> Dict[str, Any]:
        return {"source": self._source.get_state()}


def _default_names(outputs: int) -> Tuple[str, ...]:
    if outputs == 1:
        return ("data",)
    if outputs == 2:
        return ("data", "label")
    raise ValueError(f"output_names is needed for a source of {outputs} outputs")
