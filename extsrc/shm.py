"""Shared-memory segments: creation, reservation, mapping and lifetime.

A :class:`Segment` is a shared-memory file known only by its file descriptor:
an anonymous ``memfd`` by default, or (``EXTSRC_SHM_BACKEND=devshm``) a file in
/dev/shm that is unlinked the moment it is created. Either way no name is left
in /dev/shm, so a crash leaks nothing: the memory goes when the last process
holding the descriptor or a mapping exits.

``memfd`` memory does not count against the size of /dev/shm (Docker's
``--shm-size``), only against the process's memory limit. Memory is reserved
with ``posix_fallocate`` before anything is written, so running short is a
:class:`~extsrc.errors.SharedMemoryError` with the sizes involved, never a
SIGBUS in the middle of a copy.

Segments only grow. The parent creates every segment of a source before the
workers start, so workers inherit (fork) or receive (spawn, forkserver) the
descriptors once and never need new ones.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil

import numpy as np

from extsrc.errors import SharedMemoryError

PAGE = mmap.PAGESIZE
ALIGN = 64

BACKENDS = ("memfd", "devshm")


def backend() -> str:
    """The backend in force: ``$EXTSRC_SHM_BACKEND`` or ``memfd`` where the kernel has it."""
    chosen = os.environ.get("EXTSRC_SHM_BACKEND", "").strip().lower()
    if chosen:
        if chosen not in BACKENDS:
            raise ValueError(f"EXTSRC_SHM_BACKEND must be one of {BACKENDS}, got {chosen!r}")
        return chosen
    return "memfd" if hasattr(os, "memfd_create") else "devshm"


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def dev_shm_usage(path: str = "/dev/shm") -> tuple[int, int] | None:
    """``(total, free)`` bytes of the /dev/shm mount, or ``None`` if there is none."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.total, usage.free


def shm_size_mib(needed: int) -> int:
    """MiB of /dev/shm that hold ``needed`` more bytes plus what is in use, with 25% headroom."""
    usage = dev_shm_usage()
    used = usage[0] - usage[1] if usage else 0
    return -(-(needed + used) * 5 // 4 // (64 << 20)) * 64


def shm_size_advice(needed: int) -> str:
    """The ``docker run`` option that leaves room for ``needed`` bytes (see :func:`shm_size_mib`)."""
    return f"--shm-size={shm_size_mib(needed)}m"


def shortage_advice(kind: str, total_needed: int) -> str:
    """What to do when a source needing about ``total_needed`` bytes ran short."""
    need = format_bytes(total_needed)
    if kind == "devshm":
        return (
            f" This source needs about {need} of /dev/shm in all: in a container, start it with "
            f"{shm_size_advice(total_needed)} or more; or lower prefetch, batches_held or the "
            "batch size; or unset EXTSRC_SHM_BACKEND=devshm so that extsrc uses memfd memory, "
            "which does not count against /dev/shm."
        )
    return (
        f" This source needs about {need} of memory for samples in all: lower prefetch, "
        "batches_held or the batch size, or raise the process's memory limit."
    )


def with_advice(error: SharedMemoryError, kind: str, total_needed: int) -> SharedMemoryError:
    """``error`` with :func:`shortage_advice` appended to its message."""
    return SharedMemoryError(error.errno, str(error.strerror) + shortage_advice(kind, total_needed))


class Segment:
    """One shared-memory file, owned through its descriptor ``fd``.

    ``reserve(n)`` grows it to at least ``n`` bytes with memory actually
    allocated. ``close()`` drops this process's descriptor; mappings made from
    it stay valid until they are unmapped.
    """

    def __init__(self, fd: int, kind: str, label: str):
        self.fd = fd
        self.kind = kind
        self.label = label

    @classmethod
    def create(cls, label: str) -> "Segment":
        kind = backend()
        if kind == "memfd":
            fd = os.memfd_create(f"extsrc:{label}", os.MFD_CLOEXEC)
        else:
            path = f"/dev/shm/extsrc-{os.getpid()}-{os.urandom(6).hex()}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.unlink(path)
        return cls(fd, kind, label)

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def reserve(self, nbytes: int) -> int:
        """Grows the segment to at least ``nbytes`` (rounded up to a page); returns its size.

        Raises :class:`SharedMemoryError` naming the sizes when the memory cannot
        be had; nothing has been written then.
        """
        current = self.size
        if nbytes <= current:
            return current
        target = align(nbytes, PAGE)
        try:
            os.posix_fallocate(self.fd, 0, target)
        except OSError as exc:
            raise self._reserve_error(exc, current, target) from None
        return target

    def _reserve_error(self, exc: OSError, current: int, target: int) -> SharedMemoryError:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        msg = (
            f"cannot reserve {format_bytes(target)} of shared memory for {self.label} "
            f"(it had {format_bytes(current)}): {reason}."
        )
        if self.kind == "devshm":
            usage = dev_shm_usage()
            if usage:
                msg += f" /dev/shm has {format_bytes(usage[0])} in all, {format_bytes(usage[1])} free."
        return SharedMemoryError(exc.errno or errno.ENOMEM, msg)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Mapping:
    """This process's mapping of a segment, remapped larger when the segment grew.

    Arrays handed out by :meth:`array` keep their mapping alive on their own,
    so remapping never invalidates an array already given to a consumer.
    """

    def __init__(self, fd: int):
        self.fd = fd
        self.size = 0
        self.buffer: mmap.mmap | None = None

    def ensure(self, size: int) -> mmap.mmap:
        """Maps at least ``size`` bytes (the segment must already be that large)."""
        if size > self.size or self.buffer is None:
            self.buffer = mmap.mmap(self.fd, max(size, PAGE))
            self.size = max(size, PAGE)
        return self.buffer

    def array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        count = 1
        for extent in shape:
            count *= extent
        if count == 0:
            return np.empty(shape, dtype)
        return np.frombuffer(self.buffer, dtype, count, offset).reshape(shape)


class PassedFd:
    """A descriptor handed to a worker process at start.

    With ``fork`` the worker inherits it under the same number. With ``spawn``
    and ``forkserver``, pickling it inside ``Process.start()`` registers it with
    multiprocessing, which passes it to the child; ``fd`` is then the child's
    number.
    """

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_rebuild_passed_fd, (reduction.DupFd(self.fd),))


def _rebuild_passed_fd(dup) -> PassedFd:
    return PassedFd(dup.detach())
