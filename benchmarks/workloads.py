"""The callbacks ``python -m extsrc bench`` runs, identical for every loader.

They are module-level objects so that fork, spawn and forkserver workers of
any loader reach them by reference. Each workload makes sample ``idx`` by
writing ``idx`` into the first 8 bytes of a preallocated buffer taken from a
per-process ring of ``ring`` buffers (one batch's worth, so the samples of a
batch are distinct arrays even in a loader that collects a whole batch before
copying it) and returns that buffer. The content is therefore fresh per sample
while generation costs a few hundred nanoseconds, so the figures measure the
loaders, not the callback. The ring is filled once per process (in the
warm-up), so its pages are real memory, not the shared zero page.
"""

from __future__ import annotations

import os
import time
from typing import Dict, Optional, Tuple

import numpy as np

KIB = 1 << 10
MIB = 1 << 20


class Workload:
    """Makes sample ``idx`` of one workload.

    ``sample_bytes``: the size of a uint8 sample; ``batch_size``: the batch
    every loader uses; ``spin_s``: busy time per sample (on
    ``time.perf_counter``, not sleep), 0 for none.
    """

    def __init__(self, name: str, sample_bytes: int, batch_size: int, spin_s: float = 0.0,
                 fresh: bool = False, family: Optional[str] = None, epoch_batches: Optional[int] = None,
                 ragged: bool = False):
        if sample_bytes < 8:
            raise ValueError("a sample holds its 8-byte index, so it needs at least 8 bytes")
        self.name = name
        self.sample_bytes = sample_bytes
        self.batch_size = batch_size
        self.spin_s = spin_s
        self.fresh = fresh  # each sample is a new array, filled, as real callbacks make them
        self.family = family or name.split("-")[0]  # the --workloads name that selects it
        self.epoch_batches = epoch_batches  # batches per epoch (None: never ends within a cell)
        # Fresh samples of sizes that change from sample to sample, sample_bytes on average
        # (a quarter to 1.75 times it), as token sequences or encoded images come.
        self.ragged = ragged
        self._ring: Optional[Tuple[int, np.ndarray, np.ndarray]] = None  # (pid, bytes, int64 view)

    def __getstate__(self) -> Dict[str, object]:
        state = dict(self.__dict__)
        state["_ring"] = None  # each process fills its own
        return state

    def _buffers(self) -> Tuple[np.ndarray, np.ndarray]:
        ring = self._ring
        if ring is None or ring[0] != os.getpid():
            data = np.empty((self.batch_size, self.sample_bytes), np.uint8)
            data.fill(0x5A)
            ring = (os.getpid(), data, data[:, :8].view(np.int64))
            self._ring = ring
        return ring[1], ring[2]

    def make(self, idx: int, slot: Optional[int] = None) -> np.ndarray:
        """Sample ``idx``: a uint8 array of ``sample_bytes`` starting with ``idx`` as int64.

        It is buffer ``slot`` of the ring (default ``idx % batch_size``: consecutive
        indices of a batch get distinct buffers; pass ``idx_in_batch`` otherwise).
        """
        if self.spin_s:
            end = time.perf_counter() + self.spin_s
            while time.perf_counter() < end:
                pass
        if self.fresh:
            return self.fill(np.empty(self.size_of(idx), np.uint8), idx)
        data, index = self._buffers()
        k = idx % self.batch_size if slot is None else slot
        index[k, 0] = idx
        return data[k]

    def size_of(self, idx: int) -> int:
        """The bytes of sample ``idx``."""
        if not self.ragged:
            return self.sample_bytes
        return self.sample_bytes // 4 + (idx * 2654435761) % (3 * self.sample_bytes // 2)

    def fill(self, out: np.ndarray, idx: int) -> np.ndarray:
        """Writes sample ``idx`` into ``out`` (all its bytes, then the index) and returns it."""
        out.fill(idx & 0xFF)
        out[:8].view(np.int64)[0] = idx
        return out


def sample_index(sample: np.ndarray) -> int:
    """The index written into a sample (its first 8 bytes)."""
    return int(np.asarray(sample).reshape(-1)[:8].view(np.int64)[0])


SMALL = Workload("small", 1 * KIB, 256)
LARGE = Workload("large", 4 * MIB, 16)
CPU = Workload("cpu", 64, 32, spin_s=0.002)
# Large samples as real callbacks make them: a new 4 MiB array per sample, every byte written.
# With `in_place` loaders (extsrc's `in_place=True`) the callback fills the sample's place in
# shared memory instead ("large-fill"); every other loader allocates and fills.
LARGE_FRESH = Workload("large-fresh", 4 * MIB, 16, fresh=True)
LARGE_FILL = Workload("large-fill", 4 * MIB, 16, fresh=True)
# Small samples as real callbacks make them: a new 1 KiB array per sample ("small-fresh").
SMALL_FRESH = Workload("small-fresh", 1 * KIB, 256, fresh=True)
# The same of changing sizes, 256 B to 1.75 KiB (1 KiB on average): each batch a list of arrays.
RAGGED = Workload("ragged", 1 * KIB, 256, fresh=True, family="small", ragged=True)

# What PyTorch datasets return (benchmarks.loaders.torch_shaped_dataset): a new 3x32x32 float32
# tensor per sample, alone ("tensor") or in a dict with an int label ("dict"); short epochs of
# 32 batches, where the turn of an epoch counts.
TENSOR = Workload("tensor", 3 * 32 * 32 * 4, 128, family="small", epoch_batches=32)
DICT = Workload("dict", 3 * 32 * 32 * 4 + 8, 128, family="small", epoch_batches=32)
TORCH_SHAPED = ("tensor", "dict")

WORKLOADS: Dict[str, Workload] = {w.name: w for w in (SMALL, LARGE, CPU)}
EXTRA_WORKLOADS: Dict[str, Workload] = {w.name: w for w in (LARGE_FRESH, LARGE_FILL, SMALL_FRESH, RAGGED, TENSOR,
                                                             DICT)}
ALL_WORKLOADS: Dict[str, Workload] = {**WORKLOADS, **EXTRA_WORKLOADS}


def small(sample_info) -> np.ndarray:
    """1 KiB uint8 sample (a plain function, for loaders that want one)."""
    return SMALL.make(sample_info.idx_in_epoch)


def large(sample_info) -> np.ndarray:
    """4 MiB uint8 sample."""
    return LARGE.make(sample_info.idx_in_epoch)


def cpu(sample_info) -> np.ndarray:
    """64-byte sample after a 2 ms busy loop."""
    return CPU.make(sample_info.idx_in_epoch)


def large_fresh(sample_info) -> np.ndarray:
    """A new 4 MiB uint8 sample, every byte written."""
    return LARGE_FRESH.make(sample_info.idx_in_epoch)


def large_fill(sample_info, buffers) -> np.ndarray:
    """The same 4 MiB sample, written into its place in shared memory (``in_place=True``)."""
    return LARGE_FILL.fill(buffers.array(LARGE_FILL.sample_bytes, np.uint8), sample_info.idx_in_epoch)


def small_fresh(sample_info) -> np.ndarray:
    """A new 1 KiB uint8 sample, every byte written."""
    return SMALL_FRESH.make(sample_info.idx_in_epoch)


def ragged(sample_info) -> np.ndarray:
    """A new uint8 sample of 256 B to 1.75 KiB, every byte written."""
    return RAGGED.make(sample_info.idx_in_epoch)


def small_record(sample_info) -> np.ndarray:
    """1 KiB uint8 sample of ``sample_info.record`` (for sources with an order)."""
    return SMALL.make(sample_info.record, sample_info.idx_in_batch)


CALLBACKS = {"small": small, "large": large, "cpu": cpu, "large-fresh": large_fresh,
             "large-fill": large_fresh, "small-fresh": small_fresh, "ragged": ragged}
IN_PLACE_CALLBACKS = {"large-fill": large_fill}  # for loaders that let the callback write in place
RECORD_CALLBACKS = {"small": small_record}
