"""What a callback is told about the sample or batch it must produce."""

from __future__ import annotations

import collections
import functools
from typing import TYPE_CHECKING, List, NamedTuple, Optional, Tuple, Type

if TYPE_CHECKING:
    import numpy as np

    class _SampleInfoFields(NamedTuple):
        """What the type checker knows of the fields below: six ints."""

        idx_in_epoch: int
        idx_in_batch: int
        iteration: int
        epoch_idx: int
        record: int
        seed: int
else:
    _SampleInfoFields = collections.namedtuple(  # named SampleInfo: pickles as SampleInfo
        "SampleInfo", ["idx_in_epoch", "idx_in_batch", "iteration", "epoch_idx", "record", "seed"]
    )


class SampleInfo(_SampleInfoFields):
    """Identifies one sample; passed to a sample-mode callback.

    * ``idx_in_epoch``: the position in this shard's epoch,
      ``iteration * batch_size + idx_in_batch`` (as DALI defines it);
    * ``idx_in_batch``, ``iteration``, ``epoch_idx``: as DALI's;
    * ``record``: the record to load. With ``order=`` (an
      :class:`extsrc.Order`) it is where the epoch's order puts this
      position (shuffled, sharded); without, it equals ``idx_in_epoch``;
    * ``seed``: the order's seed (0 without ``order=``);
    * :attr:`rng`: a ``numpy.random.Generator`` seeded from
      ``(seed, epoch_idx, record)``: the same draws for the same record in the
      same epoch, whatever the shard, worker, start method or run.

    Immutable and hashable (a tuple of the six fields); cheap to create.
    ``SampleInfo(idx_in_epoch, idx_in_batch, iteration, epoch_idx)`` still
    works: ``record`` defaults to ``idx_in_epoch`` and ``seed`` to 0.
    """

    def __new__(cls, idx_in_epoch: int, idx_in_batch: int, iteration: int, epoch_idx: int,
                record: Optional[int] = None, seed: int = 0) -> "SampleInfo":
        record = idx_in_epoch if record is None else record
        return tuple.__new__(cls, (idx_in_epoch, idx_in_batch, iteration, epoch_idx, record, seed))

    @functools.cached_property
    def rng(self) -> np.random.Generator:
        """A ``numpy.random.Generator`` for this record in this epoch (made on first use)."""
        import numpy as np

        return np.random.default_rng((self.seed, self.epoch_idx, self.record))

    def __repr__(self) -> str:
        text = (f"SampleInfo(idx_in_epoch={self.idx_in_epoch}, idx_in_batch={self.idx_in_batch}, "
                f"iteration={self.iteration}, epoch_idx={self.epoch_idx}")
        if self.record != self.idx_in_epoch:
            text += f", record={self.record}"
        return text + ")"

    def __reduce__(self) -> Tuple[Type[SampleInfo], Tuple[int, ...]]:
        return (SampleInfo, tuple(self))  # without the cached generator


class _NotingSampleInfo(SampleInfo):
    """A :class:`SampleInfo` that notes whether ``idx_in_epoch`` and ``record`` were read."""

    __slots__ = ()
    _reads: List[bool]  # [idx_in_epoch read, record read], one list per class (see below)

    @property
    def idx_in_epoch(self) -> int:
        self._reads[0] = True
        return tuple.__getitem__(self, 0)

    @property
    def record(self) -> int:
        self._reads[1] = True
        return tuple.__getitem__(self, 4)


def noting_sample_info() -> Tuple[Type[SampleInfo], List[bool]]:
    """A ``SampleInfo`` class whose instances note reads of ``idx_in_epoch`` and ``record`` in
    the returned list (``[idx_in_epoch read, record read]``), for one source in one worker.

    Its instances are ``SampleInfo`` in every other way (and pickle as one); a read through
    indexing or unpacking is not noted.
    """
    reads = [False, False]
    cls = type("SampleInfo", (_NotingSampleInfo,), {"__slots__": (), "_reads": reads,
                                                  "__module__": __name__})
    return cls, reads


class BatchInfo(NamedTuple):
    """Identifies one batch; passed to a batch-mode callback when ``batch_info=True``."""

    iteration: int
    epoch_idx: int
