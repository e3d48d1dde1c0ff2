"""Shared-memory segments: files known only by their descriptor.

A :class:`Segment` is an anonymous ``memfd`` by default, or
(``EXTSRC_SHM_BACKEND=devshm``) an unnamed file in /dev/shm (``O_TMPFILE``,
or unlinked the moment it is created where that is missing). Either way no name is left in /dev/shm, so a crash leaks nothing:
the memory goes when the last process holding the descriptor or a mapping
of it lets go. ``memfd`` memory does not count against the size of /dev/shm
(Docker's ``--shm-size``), only against the process's memory limits.

Memory is reserved with ``posix_fallocate`` before anything is written, after
:func:`extsrc.shm.limits.check_reserve` compared the request with the limits
that apply, so running short is a :class:`~extsrc.errors.SharedMemoryError`
with the sizes involved, never a SIGBUS in the middle of a copy nor an OOM
kill. A segment's file only grows; the memory past a point can be given
back (:meth:`Segment.give_back`, a hole punched in it), and a later
:meth:`Segment.reserve` reserves that part again before it is written.

Descriptors reach workers by ``SCM_RIGHTS`` over their sockets
(:mod:`extsrc.engine.channel`); a segment is closed only by the process that
created or received it, and forked children close their inherited copies at
once (:mod:`extsrc.forking`).
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import List, Optional

from extsrc import forking
from extsrc.errors import SharedMemoryError
from extsrc.shm import limits
from extsrc.shm.layout import align
from extsrc.shm.mapping import PAGE, Mapping, MapError
from extsrc.closing import ClosedWhenCollected

BACKENDS = ("memfd", "devshm")
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _punch_hole(fd: int, offset: int, length: int) -> bool:
    """Frees the pages of ``fd`` in ``offset .. offset + length`` (Linux's ``fallocate`` with
    ``FALLOC_FL_PUNCH_HOLE``, which memfd and tmpfs files support); whether it did."""
    fallocate = getattr(_libc(), "fallocate", None)
    if fallocate is None:
        return False
    fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fallocate.restype = ctypes.c_int
    return bool(fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0)


_libc_handle: List[ctypes.CDLL] = []


def _libc() -> ctypes.CDLL:
    if not _libc_handle:
        _libc_handle.append(ctypes.CDLL(None, use_errno=True))
    return _libc_handle[0]


def backend() -> str:
    """The backend in force: ``$EXTSRC_SHM_BACKEND`` or ``memfd`` where the kernel has it."""
    chosen = os.environ.get("EXTSRC_SHM_BACKEND", "").strip().lower()
    if chosen:
        if chosen not in BACKENDS:
            raise ValueError(f"EXTSRC_SHM_BACKEND must be one of {BACKENDS}, got {chosen!r}")
        return chosen
    return "memfd" if hasattr(os, "memfd_create") else "devshm"


class Segment(ClosedWhenCollected):
    """One shared-memory file, owned through its descriptor ``fd``.

    :meth:`reserve` grows it with memory actually allocated; :meth:`map`
    maps it; :meth:`close` drops this process's descriptor (mappings stay
    valid). Closing happens only in the process that holds the segment.
    """

    __slots__ = ("fd", "kind", "label", "_pid", "_held", "__weakref__")

    def __init__(self, fd: int, kind: str, label: str):
        self.fd = fd
        self._held = os.fstat(fd).st_size  # bytes from the start this process knows reserved
        self.kind = kind
        self.label = label
        self._pid = os.getpid()
        forking.register(self)

    @classmethod
    def create(cls, label: str) -> "Segment":
        """A new, empty segment of the backend in force."""
        kind = backend()
        with forking.lock:
            try:
                if kind == "memfd":
                    fd = os.memfd_create(f"extsrc:{label}", os.MFD_CLOEXEC)
                else:
                    try:  # a file that never has a name, so nothing can ever see or leak it
                        fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
                    except (OSError, AttributeError) as exc:
                        if isinstance(exc, OSError) and exc.errno in limits.DESCRIPTOR_ERRNOS:
                            raise
                        path = f"/dev/shm/extsrc-{os.getpid()}-{os.urandom(6).hex()}"
                        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                        os.unlink(path)
            except OSError as exc:
                raise limits.out_of_descriptors(exc, f"shared memory for {label}") from None
            return cls(fd, kind, label)

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    @property
    def allocated(self) -> int:
        """The memory the segment holds now, in bytes (less than its size past a hole)."""
        return os.fstat(self.fd).st_blocks * 512

    def reserve(self, nbytes: int, total_needed: Optional[int] = None) -> int:
        """Reserves the first ``nbytes`` (a whole number of pages), growing the segment if it is
        smaller; returns the bytes reserved from its start.

        Raises :class:`SharedMemoryError` naming the sizes and the limit when
        the memory cannot be had; nothing has been written then.
        """
        held = self._held
        if nbytes <= held:
            return held
        target = align(nbytes, PAGE)
        limits.check_reserve(target - held, self.label, held, self.kind, total_needed)
        try:
            os.posix_fallocate(self.fd, 0, target)
        except OSError as exc:
            raise self._reserve_error(exc, held, target, total_needed) from None
        self._held = target
        return target

    def recount(self) -> int:
        """The bytes reserved from the start, counted again: another process may have given
        part back (:meth:`give_back` on its own descriptor)."""
        self._held = min(self._held, self.allocated)
        return self._held

    def give_back(self, keep: int) -> int:
        """Gives the memory past the first ``keep`` bytes (rounded up to a page) back to the
        system: the file keeps its size, and what it held there reads as zeros. Only for a
        part nobody reads any more. Returns the bytes reserved from the start after it (the
        file system refusing to punch the hole keeps them all)."""
        keep = align(keep, PAGE)
        size = self.size
        if keep >= size:
            return self._held
        if _punch_hole(self.fd, keep, size - keep):
            self._held = min(self._held, keep)
        return self._held

    def _reserve_error(self, exc: OSError, current: int, target: int,
                       total_needed: Optional[int]) -> SharedMemoryError:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        msg = (
            f"cannot reserve {limits.format_bytes(target)} of shared memory for {self.label} "
            f"(it had {limits.format_bytes(current)}): {reason}."
        )
        if self.kind == "devshm":
            usage = limits.dev_shm_usage()
            if usage:
                msg += (f" /dev/shm has {limits.format_bytes(usage[0])} in all, "
                        f"{limits.format_bytes(usage[1])} free.")
        msg += limits.shortage_advice(self.kind, total_needed or target)
        return SharedMemoryError(exc.errno or errno.ENOMEM, msg)

    def map(self, size: Optional[int] = None) -> Mapping:
        """Maps the first ``size`` bytes (default: all); the segment must be that large."""
        size = self.size if size is None else size
        limits.check_map(size, self.label)
        try:
            return Mapping(self.fd, size)
        except MapError as exc:
            raise SharedMemoryError(
                exc.errno, f"cannot map {limits.format_bytes(size)} of shared memory for "
                f"{self.label}: {exc.strerror}"
            ) from None

    def close(self) -> None:
        if self._pid != os.getpid():
            self.fd = -1  # a forked child's copy, closed by forget_after_fork
            return
        # Forgotten right before the close, with no call in between: a close() interrupted as
        # os.close returns and called again must not close whatever has been opened under that
        # number, and one interrupted before (at the call above) still has it to close.
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def forget_after_fork(self) -> None:
        # In a forked child: the descriptor is a copy the child must not keep (it would keep
        # the memory alive) and must never close later under a number reused by then.
        fd, self.fd = self.fd, -1  # forgotten first, as in close()
        if fd >= 0:
            forking.close_inherited((fd,))

    def __repr__(self) -> str:
        return f"<Segment {self.label!r} fd={self.fd} ({self.kind})>"
