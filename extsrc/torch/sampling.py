"""A user's ``sampler`` / ``batch_sampler`` driving a loader's workers, as DataLoader's does.

The consumer iterates the loader's index sampler (a ``BatchSampler``, or the
``sampler`` itself with ``batch_size=None``) when a loop begins, as a DataLoader's
iterator does, and writes the epoch's batches of indices to an :class:`IndexTable`
(a file per epoch in a private directory, on ``/dev/shm`` where there is one); a
worker loading batch ``k`` of epoch ``e`` (:class:`SampledBatches`) reads the table
of ``e`` once, fetches ``dataset[i]`` for each index of batch ``k`` and collates them
with ``collate_fn`` there, in the worker, as a DataLoader worker does.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import weakref
from typing import Any, Callable, List, Optional, Sequence

from extsrc.torch.structure import pack_whole

_SHM_DIR = "/dev/shm"  # memory-backed where it exists: the tables are never written to disk
TABLES_KEPT = 2  # an epoch's table outlives it by one epoch: a superseded epoch's late tasks read it


def _remove(directory: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # not from a forked child: the directory is its parent's
        shutil.rmtree(directory, ignore_errors=True)


class IndexTable:
    """The batches of indices of each epoch, written by the consumer, read by the workers.

    :meth:`write` publishes epoch ``e`` atomically (a reader sees all of it or no file);
    :meth:`read` (in a worker, by path, so any start method can read it) returns it. The
    directory is removed by :meth:`close`, or when the table is collected; only the process
    that made it removes it. Not for workers on other hosts (the files are local)."""

    def __init__(self) -> None:
        parent = _SHM_DIR if os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK) else None
        self.directory = tempfile.mkdtemp(prefix="extsrc-indices-", dir=parent)
        self._finalizer = weakref.finalize(self, _remove, self.directory, os.getpid())

    def _path(self, epoch_idx: int) -> str:
        return os.path.join(self.directory, f"epoch-{epoch_idx}.pickle")

    def write(self, epoch_idx: int, batches: List[Any]) -> None:
        """Publishes ``batches`` (batch ``k``: its indices) as epoch ``epoch_idx``'s; drops the
        tables of epochs older than :data:`TABLES_KEPT`."""
        path = self._path(epoch_idx)
        partial = path + ".partial"
        with open(partial, "wb") as file:
            pickle.dump(batches, file, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(partial, path)
        for name in os.listdir(self.directory):
            if name.startswith("epoch-") and name.endswith(".pickle"):
                epoch = int(name[len("epoch-"):-len(".pickle")])
                if epoch <= epoch_idx - TABLES_KEPT or epoch > epoch_idx:
                    try:
                        os.unlink(os.path.join(self.directory, name))
                    except FileNotFoundError:
                        pass

    def close(self) -> None:
        """Removes the directory (idempotent)."""
        self._finalizer()

    def __getstate__(self) -> dict:
        return {"directory": self.directory}  # a reader: the owner alone removes it

    def __setstate__(self, state: dict) -> None:
        self.directory = state["directory"]
        self._finalizer = None  # type: ignore[assignment]

    def read(self, epoch_idx: int) -> List[Any]:
        """Epoch ``epoch_idx``'s batches of indices (raises ``RuntimeError`` if not written)."""
        try:
            with open(self._path(epoch_idx), "rb") as file:
                return pickle.load(file)
        except FileNotFoundError:
            raise RuntimeError(
                f"the indices of epoch {epoch_idx} are not in {self.directory}: the loader that "
                "wrote them was closed, or the epoch was superseded long ago") from None


def draw_batches(index_sampler: Any, batched: bool) -> List[Any]:
    """One epoch of ``index_sampler`` (iterated now, in this process, as DataLoader's iterator
    does it): a list of batches of indices (each index alone when not ``batched``)."""
    if batched:
        return [list(batch) for batch in index_sampler]
    return [index for index in index_sampler]


class SampledBatches:
    """The workers' callback (sample mode, in place, one "sample" per batch) of a loader with a
    sampler: batch ``info.idx_in_epoch`` of epoch ``info.epoch_idx`` is the batch of indices the
    :class:`IndexTable` holds there, fetched and collated by ``collate_fn`` (with
    ``batched=False``, the one index's sample, converted by ``collate_fn``), packed whole into
    the batch's shared memory. Past the epoch's last batch it raises ``StopIteration``."""

    def __init__(self, dataset: Any, collate_fn: Callable[[Any], Any], table: IndexTable, batched: bool):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.table = table
        self.batched = batched
        self._epoch: Optional[int] = None  # of the batches cached (made in the worker)
        self._batches: Sequence[Any] = ()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_epoch": None, "_batches": ()}

    def __call__(self, info: Any, buffers: Any) -> Any:
        if self._epoch != info.epoch_idx:
            self._batches = self.table.read(info.epoch_idx)
            self._epoch = info.epoch_idx
        k = info.idx_in_epoch
        if k >= len(self._batches):
            raise StopIteration
        indices = self._batches[k]
        if self.batched:
            batch = self.collate_fn([self._fetch(index) for index in indices])
        else:
            batch = self.collate_fn(self._fetch(indices))
        return pack_whole(batch, buffers, f"batch {k} (indices {indices!r})")

    def _fetch(self, index: Any) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(extsrc.torch: raised by dataset[{index!r}])")
            raise
