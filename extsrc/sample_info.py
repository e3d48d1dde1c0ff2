"""What a callback is told about the sample or batch it must produce."""

from __future__ import annotations

from typing import NamedTuple


class SampleInfo(NamedTuple):
    """Identifies one sample; passed to a sample-mode callback.

    ``idx_in_epoch == iteration * batch_size + idx_in_batch``. Immutable and
    hashable; cheap to create (a tuple).
    """

    idx_in_epoch: int
    idx_in_batch: int
    iteration: int
    epoch_idx: int


class BatchInfo(NamedTuple):
    """Identifies one batch; passed to a batch-mode callback when ``batch_info=True``."""

    iteration: int
    epoch_idx: int
