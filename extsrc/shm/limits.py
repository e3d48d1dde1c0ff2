"""How much shared memory this process may still take, and what to say when it runs short.

Sample memory is reserved before anything is written (``posix_fallocate``),
and the reservation is first compared with every limit that applies to the
process, so that asking for too much is a
:class:`~extsrc.errors.SharedMemoryError` that gives the sizes and the fix,
never an out-of-memory kill of the consumer or a worker:

* the memory cgroup (a container's ``--memory``, a Kubernetes limit,
  systemd's ``MemoryMax``), v1 or v2, including every parent cgroup: memfd
  memory is charged to the cgroup of the process that reserves it, and a
  cgroup over its limit invokes the OOM killer rather than failing the call;
* the machine's ``MemAvailable``;
* for mappings, ``RLIMIT_AS`` (``ulimit -v``) against the address space in use;
* with ``EXTSRC_SHM_BACKEND=devshm``, the free space of /dev/shm
  (Docker's ``--shm-size``).
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Type, overload

from extsrc.errors import SharedMemoryError

# Memory left to everything else of the process (the interpreter, the
# callback's own arrays, page tables) when reserving: reserving up to the last
# byte would only move the OOM kill to the next allocation.
HEADROOM = 64 << 20

_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge page-aligned number


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass(frozen=True)
class Limit:
    """One limit on this process's memory: what it is, its size, what is in use under it."""

    name: str  # e.g. "the memory cgroup /docker/abc (memory.max)"
    limit: int
    used: int

    @property
    def room(self) -> int:
        return max(0, self.limit - self.used)

    def describe(self) -> str:
        return f"{self.name}: {format_bytes(self.limit)}, {format_bytes(self.used)} in use"


# -- reading the limits --------------------------------------------------------------------


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat(path: str) -> Dict[str, int]:
    stats: Dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    stats[key] = int(value)
    except OSError:
        pass
    return stats


def _cgroup_mounts() -> List[Tuple[str, str, str]]:
    """``(version, mount root within the hierarchy, mount point)`` of memory cgroup hierarchies."""
    mounts = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) < 5 or len(rfields) < 3:
                    continue
                fstype, options = rfields[0], rfields[2]
                if fstype == "cgroup2":
                    mounts.append(("v2", fields[3], fields[4]))
                elif fstype == "cgroup" and "memory" in options.split(","):
                    mounts.append(("v1", fields[3], fields[4]))
    except OSError:
        pass
    return mounts


def _own_cgroups() -> Dict[str, str]:
    """This process's cgroup path per version (``v1``: of the memory controller)."""
    paths: Dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and parts[1] == "":
                    paths["v2"] = parts[2]
                elif "memory" in parts[1].split(","):
                    paths["v1"] = parts[2]
    except OSError:
        pass
    return paths


def own_cgroup_dirs() -> List[Tuple[str, str, str]]:
    """``(version, directory, mount point)`` of this process's memory cgroup, per hierarchy."""
    found = []
    own = _own_cgroups()
    for version, root, mount_point in _cgroup_mounts():
        path = own.get(version)
        if path is None:
            continue
        relative = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
        directory = os.path.normpath(os.path.join(mount_point, relative))
        if not directory.startswith(mount_point):
            directory = mount_point
        found.append((version, directory, mount_point))
    return found


def _cgroup_limits() -> List[Limit]:
    limits = []
    for version, directory, mount_point in own_cgroup_dirs():
        while True:
            limit = _cgroup_limit_at(version, directory, mount_point)
            if limit is not None:
                limits.append(limit)
            if directory == mount_point or len(directory) <= len(mount_point):
                break
            directory = os.path.dirname(directory)
    return limits


def _cgroup_limit_at(version: str, directory: str, mount_point: str) -> Optional[Limit]:
    if version == "v2":
        limit = _read_int(os.path.join(directory, "memory.max"))
        used = _read_int(os.path.join(directory, "memory.current"))
        reclaimable = _read_stat(os.path.join(directory, "memory.stat")).get("inactive_file", 0)
        file = "memory.max"
    else:
        limit = _read_int(os.path.join(directory, "memory.limit_in_bytes"))
        used = _read_int(os.path.join(directory, "memory.usage_in_bytes"))
        stat = _read_stat(os.path.join(directory, "memory.stat"))
        reclaimable = stat.get("total_inactive_file", stat.get("inactive_file", 0))
        file = "memory.limit_in_bytes"
    if limit is None or used is None or limit >= _UNLIMITED:
        return None
    name = "/" + os.path.relpath(directory, mount_point).lstrip(".")
    return Limit(f"the memory cgroup {name or '/'} ({file})", limit, max(0, used - reclaimable))


def _mem_available() -> Optional[Limit]:
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
    except (OSError, ValueError):
        return None
    if "MemTotal" not in info or "MemAvailable" not in info:
        return None
    return Limit("the machine's memory (MemAvailable)", info["MemTotal"],
                 info["MemTotal"] - info["MemAvailable"])


def _address_space() -> Optional[Limit]:
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return None
    return Limit("the address space limit RLIMIT_AS (ulimit -v)", soft, size)


def memory_limits() -> List[Limit]:
    """Every limit on the memory this process may reserve for samples (cgroups, MemAvailable)."""
    limits = _cgroup_limits()
    available = _mem_available()
    if available is not None:
        limits.append(available)
    return limits


def room_left() -> Optional[int]:
    """Bytes left under the tightest limit on this process's memory (:func:`memory_limits`)
    and address space (RLIMIT_AS); ``None`` when none is known."""
    limits = memory_limits()
    address_space = _address_space()
    if address_space is not None:
        limits.append(address_space)
    limit = tightest(limits)
    return None if limit is None else limit.room


def tightest(limits: List[Limit]) -> Optional[Limit]:
    return min(limits, key=lambda limit: limit.room, default=None)


# -- checks --------------------------------------------------------------------------------


def source_need(batch_bytes: int, slots_kept: int) -> int:
    """Shared memory a source needs at most, in bytes: a batch in each slot it keeps
    (``prefetch + batches_held``), plus the first batch, which goes to the workers' overflow
    segments before the layout of the samples is known."""
    return (slots_kept + 1) * batch_bytes


DEV_SHM = "/dev/shm (its size: Docker's --shm-size)"


def _dev_shm_limit() -> Optional[Limit]:
    usage = dev_shm_usage()
    if usage is None:
        return None
    total, free = usage
    return Limit(DEV_SHM, total, total - free)


def check_source_need(need: int, what: str, kind: str, detail: str) -> None:
    """Raises :class:`SharedMemoryError` if a source needing ``need`` bytes in all cannot have them.

    Called before any of it is reserved (at the first sample, when its size
    is known), so that a request no limit allows fails at once, with nothing
    taken, instead of after reserving as much as the limits allow. Compared
    with every limit: the memory cgroups, ``MemAvailable``, ``RLIMIT_AS``
    and, for ``kind == "devshm"``, the free space of /dev/shm. ``what``
    names the source, ``detail`` says how ``need`` was counted.
    """
    found = memory_limits()
    for extra in (_address_space(), _dev_shm_limit() if kind == "devshm" else None):
        if extra is not None:
            found.append(extra)
    limit = tightest(found)
    if limit is None or need + HEADROOM <= limit.room:
        return
    found_text = f"{limit.describe()}, so {format_bytes(limit.room)} is left"
    if limit.name == DEV_SHM:
        found_text = (f"/dev/shm has {format_bytes(limit.limit)} in all, {format_bytes(limit.room)} "
                      "free (its size: Docker's --shm-size)")
        advice = shortage_advice("devshm", need)
    elif "RLIMIT_AS" in limit.name:
        advice = (" Raise the limit (ulimit -v unlimited), or lower prefetch or the batch size, "
                  "or hold fewer batches.")
    else:
        advice = shortage_advice("memfd", need, limit)  # memory, wherever the segments live
    raise SharedMemoryError(
        errno.ENOMEM,
        f"{what} needs about {format_bytes(need)} of shared memory ({detail}), and "
        f"{found_text}, of which extsrc keeps {format_bytes(HEADROOM)} for everything else. "
        f"Nothing was reserved.{advice}",
    )


def check_reserve(nbytes: int, what: str, current: int, kind: str,
                  total_needed: Optional[int] = None) -> None:
    """Raises :class:`SharedMemoryError` if reserving ``nbytes`` more would break a limit.

    ``what`` names the memory (``"source '#0', slot 3"``), ``current`` is what
    it already has; ``total_needed`` what the source needs in all, for the advice
    (without it, the caller adds the advice with :func:`with_advice`).
    """
    limit = tightest(memory_limits())
    if limit is None or nbytes + HEADROOM <= limit.room:
        return
    raise SharedMemoryError(
        errno.ENOMEM,
        f"cannot reserve {format_bytes(nbytes)} more shared memory for {what} (it has "
        f"{format_bytes(current)}): {limit.describe()}, so {format_bytes(limit.room)} is left, "
        f"and extsrc keeps {format_bytes(HEADROOM)} of that for everything else."
        + ("" if total_needed is None else shortage_advice(kind, total_needed, limit)),
    )


def check_map(nbytes: int, what: str) -> None:
    """Raises :class:`SharedMemoryError` if mapping ``nbytes`` would pass ``RLIMIT_AS``."""
    limit = _address_space()
    if limit is None or nbytes <= limit.room:
        return
    raise SharedMemoryError(
        errno.ENOMEM,
        f"cannot map {format_bytes(nbytes)} of shared memory for {what}: {limit.describe()}, "
        f"so {format_bytes(limit.room)} of address space is left. Raise the limit "
        "(ulimit -v unlimited), or lower prefetch or the batch size.",
    )


# -- /dev/shm and advice -------------------------------------------------------------------


def dev_shm_usage(path: str = "/dev/shm") -> Optional[Tuple[int, int]]:
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


def shortage_advice(kind: str, total_needed: int, limit: Optional[Limit] = None) -> str:
    """What to do when a source needing about ``total_needed`` bytes ran short."""
    need = format_bytes(total_needed)
    if kind == "devshm":
        return (
            f" This source needs about {need} of /dev/shm in all: in a container, start it with "
            f"{shm_size_advice(total_needed)} or more; or lower prefetch or the batch size, or "
            "hold fewer batches; or unset EXTSRC_SHM_BACKEND=devshm so that extsrc uses memfd "
            "memory, which does not count against /dev/shm."
        )
    raise_limit = "raise the process's memory limit"
    if limit is None:
        limit = tightest(memory_limits())
    if limit is not None and "cgroup" in limit.name:
        raise_limit = ("raise the container's memory limit (docker run --memory, the pod's "
                       "resources.limits.memory)")
    return (
        f" This source needs about {need} of memory for samples in all: lower prefetch or the "
        f"batch size, hold fewer batches at a time, or {raise_limit}."
    )


def with_advice(error: SharedMemoryError, kind: str, total_needed: int) -> SharedMemoryError:
    """``error`` with :func:`shortage_advice` appended, unless it already gives advice."""
    text = str(error.strerror)
    if "This source needs about" in text or error.errno in DESCRIPTOR_ERRNOS:
        return error
    return SharedMemoryError(error.errno, text + shortage_advice(kind, total_needed))


# -- descriptors ---------------------------------------------------------------------------

DESCRIPTOR_ERRNOS = (errno.EMFILE, errno.ENFILE)


def out_of_descriptors(exc: OSError, what: str, error_type: Type[OSError] = SharedMemoryError) -> OSError:
    """``exc`` (``EMFILE``/``ENFILE``) as an ``error_type`` that names the limit and what to do.

    ``what`` is what needed the descriptor (``"shared memory for source '#0', slot 3"``).
    Any other ``exc`` is returned unchanged.
    """
    if exc.errno not in DESCRIPTOR_ERRNOS:
        return exc
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if exc.errno == errno.ENFILE:
        reason = "the machine's table of open files is full (ENFILE, fs.file-max)"
    else:
        reason = f"this process may have {soft} open descriptors (RLIMIT_NOFILE, ulimit -n)"
    if hard == resource.RLIM_INFINITY or hard > soft:
        shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        advice = (f"raise the limit (ulimit -n {shown} in the shell, or at the start of the "
                  "program resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)) with the hard "
                  f"limit, {shown} here)")
    else:
        advice = "raise the hard limit (ulimit -Hn, or the container's nofile limit)"
    return error_type(
        exc.errno,
        f"cannot open a descriptor for {what}: {reason}. Each source holds about "
        "(1 + num_workers) descriptors per batch it keeps ready, and a pool a few per worker: "
        f"close the sources no longer used, lower prefetch or batches_held, or {advice}.",
    )


def descriptor_limit() -> Optional[int]:
    """The descriptors this process may have open (RLIMIT_NOFILE's soft limit); ``None``
    for no limit."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def check_descriptors(needed: int, what: str, error_type: type = OSError) -> None:
    """Raises ``error_type`` (see :func:`out_of_descriptors`) if fewer than ``needed``
    descriptors are left under RLIMIT_NOFILE: a step that would run out part way (starting
    workers) is refused before it begins."""
    soft = descriptor_limit()
    if soft is None:
        return
    try:
        in_use = len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself opened
    except OSError as exc:
        if exc.errno not in DESCRIPTOR_ERRNOS:
            return  # no /proc: the step itself will tell
        in_use = soft
    if in_use + needed > soft:
        raise out_of_descriptors(OSError(errno.EMFILE, os.strerror(errno.EMFILE)),
                                 f"{what} (it needs about {needed})", error_type)


def thread_start_error(exc: BaseException, what: str) -> OSError:
    """Why a thread could not start (``exc``, a ``RuntimeError``), naming the address space
    limit when there is one: each thread reserves its stack from it."""
    limit = _address_space()
    if limit is None:
        return OSError(errno.EAGAIN, f"cannot start {what}: {exc} (the process or user may have "
                                     "reached its limit of threads, ulimit -u)")
    return OSError(
        errno.ENOMEM,
        f"cannot start {what} ({exc}): {limit.describe()}, so {format_bytes(limit.room)} of "
        "address space is left, and a thread reserves its stack (8 MiB by default) from it. "
        "Raise the limit (ulimit -v unlimited).",
    )


@overload
def copy_error(nbytes: int, what: str) -> Optional[SharedMemoryError]: ...
@overload
def copy_error(nbytes: int, what: str, cause: BaseException) -> SharedMemoryError: ...
def copy_error(nbytes: int, what: str, cause: Optional[BaseException] = None) -> Optional[SharedMemoryError]:
    """The error for a private copy of ``nbytes`` (``what`` names it) that the process's limits
    leave no room for (RLIMIT_AS, a memory cgroup, MemAvailable), or that failed with
    ``cause`` (a ``MemoryError``); ``None`` when there is room and nothing failed."""
    # Address space is all this copy takes; of memory, extsrc leaves HEADROOM to the rest.
    for limit, spare in ((_address_space(), 0), (tightest(memory_limits()), HEADROOM)):
        if limit is not None and (cause is not None or nbytes + spare > limit.room):
            return SharedMemoryError(
                errno.ENOMEM,
                f"cannot make {what} ({format_bytes(nbytes)}): {limit.describe()}, so "
                f"{format_bytes(limit.room)} is left. Raise the limit, or lower the batch size.",
            )
    if cause is not None:
        return SharedMemoryError(errno.ENOMEM, f"cannot make {what} ({format_bytes(nbytes)}): "
                                               f"out of memory ({str(cause) or 'MemoryError'}).")
    return None
