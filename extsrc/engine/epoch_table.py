"""Data of each epoch that the consumer decides and the workers read: :class:`EpochTable`.

A layer whose order is drawn in the consumer (a user's sampler, a seed drawn
when a loop begins) publishes each epoch's list with :meth:`EpochTable.write`
before the epoch's tasks are sent; a worker, whatever its start method, reads
it with :meth:`EpochTable.read` or :meth:`EpochTable.batch` when its first
task of that epoch runs. Who calls what: the consumer's thread that begins
epochs writes and closes; workers (or the pool's threads, for a thread
backend) read. Local to one host.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import tempfile
import weakref
from typing import Any, Dict, List, Optional, Sequence

_SHM_DIR = "/dev/shm"  # memory-backed where it exists: the tables are never written to disk
TABLES_KEPT = 2  # an epoch's table outlives it by one epoch: a superseded epoch's late tasks read it
_MEMFD_PREFIX = "extsrc-epochs-"  # a table's memfd is named <prefix><token>-epoch-<e>


def _remove(directory: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # not from a forked child: the directory is its parent's
        shutil.rmtree(directory, ignore_errors=True)


def _close_fds(fds: Dict[int, int], owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        for fd in fds.values():
            os.close(fd)
    fds.clear()


def _memfd_usable() -> bool:
    return (hasattr(os, "memfd_create") and hasattr(fcntl, "F_GET_SEALS")
            and os.path.isdir(f"/proc/{os.getpid()}/fd"))


def _loaded(data: bytes) -> List[Any]:
    table: List[Any] = pickle.loads(data)
    return table


class EpochTable:
    """A list per epoch (e.g. its batches of indices), written by the consumer, read by workers.

    :meth:`write` publishes epoch ``e`` atomically (a reader sees all of it or nothing);
    :meth:`read` (in a worker, whatever its start method) returns it. On Linux each epoch is
    a sealed memfd of the consumer that workers open through ``/proc/<consumer>/fd``: it has
    no name in any file system, so nothing is left behind even when the consumer is killed.
    Elsewhere each epoch is a file in a private directory (on ``/dev/shm`` where there is one)
    removed by :meth:`close` or when the table is collected. Only the process that made the
    table frees it. Not for workers on other hosts (the tables are local)."""

    def __init__(self) -> None:
        self._owner = os.getpid()
        self._fds: Dict[int, int] = {}  # epoch -> memfd (memfd mode)
        self._finalizer: "weakref.finalize[Any, Any]"
        self._read: Optional[Sequence[Any]] = None  # a reader's batches of _read_epoch
        self._read_epoch = -1
        if _memfd_usable():
            self.directory: Optional[str] = None
            self._token = f"{self._owner}-{os.urandom(6).hex()}"
            self._finalizer = weakref.finalize(self, _close_fds, self._fds, self._owner)
        else:
            parent = _SHM_DIR if os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK) else None
            self.directory = tempfile.mkdtemp(prefix="extsrc-epochs-", dir=parent)
            self._token = ""
            self._finalizer = weakref.finalize(self, _remove, self.directory, self._owner)

    def _path(self, epoch_idx: int) -> str:
        assert self.directory is not None
        return os.path.join(self.directory, f"epoch-{epoch_idx}.pickle")

    def _memfd_name(self, epoch_idx: int) -> str:
        return f"{_MEMFD_PREFIX}{self._token}-epoch-{epoch_idx}"

    def write(self, epoch_idx: int, batches: List[Any]) -> None:
        """Publishes ``batches`` (item ``k``: what task ``k`` of the epoch reads) as epoch
        ``epoch_idx``'s; drops the tables of epochs older than :data:`TABLES_KEPT`."""
        data = pickle.dumps(batches, protocol=pickle.HIGHEST_PROTOCOL)
        if self.directory is None:
            fd = os.memfd_create(self._memfd_name(epoch_idx), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                # sealed once whole: a reader takes only a sealed table (see read())
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW
                            | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            except BaseException:
                os.close(fd)
                raise
            old = self._fds.pop(epoch_idx, None)
            self._fds[epoch_idx] = fd
            if old is not None:
                os.close(old)
            for epoch in list(self._fds):
                if epoch <= epoch_idx - TABLES_KEPT or epoch > epoch_idx:
                    os.close(self._fds.pop(epoch))
            return
        path = self._path(epoch_idx)
        partial = path + ".partial"
        with open(partial, "wb") as file:
            file.write(data)
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
        """Frees the tables (idempotent)."""
        self._finalizer()

    def __getstate__(self) -> Dict[str, Any]:
        # a reader: the owner alone frees the tables
        return {"directory": self.directory, "_token": self._token, "_owner": self._owner}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fds, self._read, self._read_epoch = {}, None, -1
        self._finalizer = None  # type: ignore[assignment]

    def read(self, epoch_idx: int) -> List[Any]:
        """Epoch ``epoch_idx``'s list (raises ``RuntimeError`` if it was not written)."""
        if self.directory is None:
            data = self._read_memfd(epoch_idx)
            if data is not None:
                return _loaded(data)
            where = f"the memory of process {self._owner}"
        else:
            where = self.directory
            try:
                with open(self._path(epoch_idx), "rb") as file:
                    return _loaded(file.read())
            except FileNotFoundError:
                pass
        raise RuntimeError(
            f"the table of epoch {epoch_idx} is not in {where}: the loader that "
            "wrote it was closed, or the epoch was superseded long ago")

    def batch(self, epoch_idx: int, k: int) -> Any:
        """Item ``k`` of epoch ``epoch_idx`` (its table read once); ``StopIteration`` past the last."""
        if self._read is None or self._read_epoch != epoch_idx:
            self._read, self._read_epoch = self.read(epoch_idx), epoch_idx
        if k >= len(self._read):
            raise StopIteration
        return self._read[k]

    def _read_memfd(self, epoch_idx: int) -> Optional[bytes]:
        """The sealed table of ``epoch_idx`` among the owner's descriptors, or None."""
        if os.getpid() == self._owner:  # the loader's own process (a worker in a thread)
            fd = self._fds.get(epoch_idx)
            return os.pread(fd, os.fstat(fd).st_size, 0) if fd is not None else None
        target = f"/memfd:{self._memfd_name(epoch_idx)} (deleted)"
        fd_dir = f"/proc/{self._owner}/fd"
        try:
            names = os.listdir(fd_dir)
        except FileNotFoundError:
            return None  # the consumer is gone
        except PermissionError:
            raise RuntimeError(
                f"the worker (pid {os.getpid()}) cannot read {fd_dir}, where the loader's process "
                "keeps each epoch's table (e.g. a sampler's indices): run the workers as the same user, "
                "with /proc mounted without hidepid") from None
        for name in names:
            try:
                if os.readlink(f"{fd_dir}/{name}") != target:
                    continue
                fd = os.open(f"{fd_dir}/{name}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # closed meanwhile
            try:
                # the number may have been reused since readlink: check what was opened
                if os.readlink(f"/proc/self/fd/{fd}") != target:
                    continue
                if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE:
                    continue  # still being written
                return os.pread(fd, os.fstat(fd).st_size, 0)
            finally:
                os.close(fd)
        return None
