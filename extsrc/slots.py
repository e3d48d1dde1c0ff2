"""Parent side of shared memory: the slots of a source and where they are freed.

A source owns a ring of slots, each able to hold one batch: one segment shared
by all workers (the in-place regions, one per output) and one overflow segment
per worker. A slot is *free*, or *busy* from the moment a batch is dispatched
into it until :meth:`SlotRing.release`, which happens when the consumer has
taken ``batches_held`` newer batches, or, for a batch nobody will read
(abandoned epoch), once its last task has reported back.

The number of slots is ``prefetch + batches_held``. All segments are created
here, empty, before the workers start; they only grow. ``close()`` drops the
parent's descriptors; the memory itself is gone once the workers have exited
and the consumer's last array of it is garbage.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from extsrc.shm import Mapping, PassedFd, Segment


class Slot:
    """Memory for one batch: the shared region segment and per-worker overflow."""

    def __init__(self, index: int, label: str, num_workers: int):
        self.index = index
        self.segment = Segment.create(f"{label} slot {index}")
        self.mapping = Mapping(self.segment.fd)
        self.overflow = [
            Segment.create(f"{label} slot {index} worker {w}") for w in range(num_workers)
        ]
        self.overflow_maps = [Mapping(seg.fd) for seg in self.overflow]
        self.busy = False

    def prepare(self, size: int) -> int:
        """Reserves ``size`` bytes of region memory and maps them; returns the segment size."""
        if size == 0:
            return self.segment.size
        reserved = self.segment.reserve(size)
        self.mapping.ensure(reserved)
        return reserved

    def overflow_view(self, worker: int, size: int) -> Mapping:
        mapping = self.overflow_maps[worker]
        if size > mapping.size:
            mapping.ensure(size)
        return mapping

    def region_array(self, offset: int, dtype: np.dtype, shape: tuple) -> np.ndarray:
        return self.mapping.array(offset, dtype, shape)

    def close(self) -> None:
        self.segment.close()
        for segment in self.overflow:
            segment.close()


class SlotRing:
    """The slots of one source; hands out free ones and takes them back."""

    def __init__(self, label: str, count: int, num_workers: int):
        self.slots: List[Slot] = []
        try:
            for index in range(count):
                self.slots.append(Slot(index, label, num_workers))
        except BaseException:
            self.close()
            raise

    def acquire(self) -> Optional[Slot]:
        """A free slot, now busy; ``None`` when all are busy."""
        for slot in self.slots:
            if not slot.busy:
                slot.busy = True
                return slot
        return None

    def release(self, slot: Slot) -> None:
        """Makes ``slot`` reusable: its arrays may be overwritten from now on."""
        slot.busy = False

    def worker_fds(self, worker: int) -> tuple[List[PassedFd], List[PassedFd]]:
        """The descriptors worker ``worker`` writes: every slot segment, its own overflow."""
        return (
            [PassedFd(slot.segment.fd) for slot in self.slots],
            [PassedFd(slot.overflow[worker].fd) for slot in self.slots],
        )

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
