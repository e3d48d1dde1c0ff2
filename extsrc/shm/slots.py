"""The consumer side of a source's shared memory: slots, their states, and leases.

A *slot* is the memory of one batch: one segment for the in-place regions
(where uniform outputs are written side by side, so the batch is one dense
array) and, per worker, one overflow segment (samples that do not fit their
region). :class:`SlotPool` is the one owner of a source's slots: every state
change goes through it and is checked.

Slot states::

                 acquire()                 all tasks reported            commit()
      FREE ─────────────────► FILLING ───────────────────────► READY ───────────► LEASED
       ▲  ▲                      │                               │                    │
       │  │        drained       │ abandon()          abandon()  │                    │ last array
       │  └──────── DRAINING ◄───┘                               │                    │ of the batch
       │                                                         │                    │ is gone
       └─────────────────────────────────────────────────────────┴────────────────────┘
      FREE ──► RETIRED: trim() (more slots than needed), a fork while leased, close()
      LEASED ──► RETIRED: acquire() with every slot held and ``keep`` of them allocated

* **FREE**: nothing references the memory; it waits for a batch.
* **FILLING**: a batch was dispatched into it; workers may write.
* **DRAINING**: its batch was abandoned (a new epoch, ``set_state``) while
  workers may still write; it becomes FREE when every task reported back.
* **READY**: every task reported back; the consumer has not taken it yet.
* **LEASED**: the batch was handed out. Its arrays, and every view, slice or
  tensor made from them, hold a :class:`Lease`; when the last of them is
  gone, the lease returns the slot. Only then is the memory written again.
* **RETIRED**: out of the pool (terminal): its descriptors are closed and
  the workers drop it. Its memory goes back to the system once no lease
  holds it: a slot retired while LEASED (a consumer keeping more batches
  than the pool keeps slots) stays mapped, its batch valid, until the batch
  is dropped; so descriptors stay bounded however many batches are kept.

Threads: every method runs with the pool's lock held, except the lease's
return, which happens in whatever thread drops the last reference: it only
appends to :attr:`SlotPool.returns` (from C, see :class:`Lease`); the pool's
thread applies it (:meth:`SlotPool.process_returns`) at its next round, at
the latest :data:`~extsrc.engine.pool.RETURN_POLL_S` later.

Memory: mappings are reference-counted; a lease holds the mappings of its
batch, the pool holds those of its live slots. ``close()`` (and retiring)
drops the pool's references, so memory no lease holds is unmapped at once;
a held batch keeps its memory until it is dropped, even after ``close()``.
"""

from __future__ import annotations

import enum
import weakref
from collections import deque
from typing import Callable, Deque, Dict, FrozenSet, List, Optional, Protocol, Sequence, Set, Tuple

from extsrc import forking
from extsrc.arrays import Array
from extsrc.engine import policy
from extsrc.errors import InternalError
from extsrc.shm.mapping import Mapping, array_base, owner_of
from extsrc.shm.segment import Segment


class SlotState(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    DRAINING = "draining"
    READY = "ready"
    LEASED = "leased"
    RETIRED = "retired"

    __hash__ = object.__hash__  # members are singletons; the default hashes the name, slowly


_ALLOWED = {
    SlotState.FREE: frozenset({SlotState.FILLING, SlotState.RETIRED}),
    SlotState.FILLING: frozenset({SlotState.READY, SlotState.DRAINING}),
    SlotState.DRAINING: frozenset({SlotState.FREE}),
    SlotState.READY: frozenset({SlotState.LEASED, SlotState.FREE}),
    SlotState.LEASED: frozenset({SlotState.READY, SlotState.FREE, SlotState.RETIRED}),
    SlotState.RETIRED: frozenset(),
}


class WorkerLink(Protocol):
    """How a slot pool tells the workers about slots (implemented by the worker pool).

    Called with the pool's lock held. Messages reach each worker in the order
    sent, before any task sent after them.
    """

    def add_slot(self, source_id: int, slot_id: int, region_fd: int,
                 overflow_fds: Sequence[int]) -> None:
        """Sends every worker the region descriptor and its own overflow descriptor."""

    def drop_slot(self, source_id: int, slot_id: int) -> None:
        """Tells every worker to close and unmap the slot."""



class Slot:
    """Memory for one batch; its state is changed only by its :class:`SlotPool`."""

    __slots__ = ("slot_id", "state", "region", "region_map", "overflow", "overflow_maps",
                 "batch_seq", "lease_seq", "lease_generation", "retire_when_free",
                 "overflow_bound", "writers")

    def __init__(self, slot_id: int, label: str, num_workers: int):
        self.slot_id = slot_id
        self.state = SlotState.FREE
        self.region = Segment.create(f"{label}, slot {slot_id}")
        self.overflow: List[Segment] = []
        try:
            for worker in range(num_workers):
                self.overflow.append(Segment.create(f"{label}, slot {slot_id}, worker {worker}"))
        except BaseException:
            self.close_segments()
            raise
        self.region_map: Optional[Mapping] = None
        self.overflow_maps: List[Optional[Mapping]] = [None] * num_workers
        self.batch_seq = -1  # the batch it holds (or last held)
        self.lease_seq = 0
        self.lease_generation = 0
        self.retire_when_free = False
        # Per worker, bytes its overflow segment may hold at most (after a task, a worker keeps
        # policy.OVERFLOW_KEEP times what it wrote; UNKNOWN after a failed task); and the
        # workers whose overflow holds samples of the batch the slot holds now.
        self.overflow_bound: List[int] = [0] * num_workers
        self.writers: FrozenSet[int] = frozenset()

    def close_segments(self) -> None:
        self.region.close()
        for segment in self.overflow:
            segment.close()

    def __repr__(self) -> str:
        return f"<Slot {self.slot_id} {self.state.value}>"


def _nbytes(slot: Slot) -> int:
    """The shared memory of ``slot`` (its region and overflow segments), in bytes: what the
    overflow segments hold, which the workers give back in part (a hole below their size)."""
    return slot.region.size + sum(s.allocated for s in slot.overflow)


class Lease:
    """The consumer's hold on a slot, alive while any array of its batch is.

    Every array of a batch reaches its memory through the lease (see
    :func:`extsrc.shm.mapping.array_base`), so the lease dies exactly when
    the last array, view, slice or tensor made from the batch does. It holds
    the batch's mappings (:attr:`region`, :attr:`overflow` by worker), so the
    memory stays mapped until then even if the source was closed.

    Its death is noticed by a weak reference whose callback is
    ``deque.append``, which runs no Python code: a ``KeyboardInterrupt``
    arriving while the last array is dropped cannot lose the return.
    """

    __slots__ = ("slot_id", "seq", "region", "overflow", "ref", "__weakref__")

    def __init__(self, slot_id: int, seq: int, region: Optional[Mapping],
                 overflow: Dict[int, Mapping]):
        self.slot_id = slot_id
        self.seq = seq
        self.region = region
        self.overflow = overflow
        self.ref: Optional["weakref.ReferenceType[Lease]"] = None

    @property
    def mappings(self) -> Tuple[Mapping, ...]:
        head = () if self.region is None else (self.region,)
        return head + tuple(self.overflow.values())

    def base(self, mapping: Mapping) -> Array:
        """All of ``mapping`` (one of :attr:`mappings`) as a uint8 array whose views keep
        this lease alive. Callers keep it no longer than they need to make views."""
        return array_base(mapping, self)


_UNKNOWN = 1 << 62  # an overflow bound: what a failed task left there is not known


def lease_of(array: object) -> Optional[Lease]:
    """The lease that keeps ``array`` (an array of a batch, or a view of one) valid, if any."""
    owner = owner_of(array)
    return owner if isinstance(owner, Lease) else None


class SlotPool:
    """The slots of one source; the only place their states change (see the module doc).

    ``keep`` is how many slots stay allocated when free (the source's
    prefetch plus the batches a consumer usually holds): up to that many,
    steady state allocates nothing; beyond it, a slot held by the consumer
    leaves the pool for each new one made (it is freed when dropped), so
    the pool never has more than ``keep`` slots, nor their descriptors.
    """

    def __init__(self, source_id: int, label: str, num_workers: int, keep: int, link: WorkerLink):
        self.source_id = source_id
        self.label = label
        self.num_workers = num_workers
        self.keep = keep
        self.link = link
        self.slots: Dict[int, Slot] = {}
        self.ready = 0  # slots READY now (batches finished and not taken), kept by _move
        self.draining = 0  # slots DRAINING now (batches abandoned while workers write), kept by _move
        # id(weak reference of a live lease) -> (slot id, lease seq, the reference); a dead
        # lease's reference lands in `returns` (see Lease). Keyed by id: a dead reference
        # whose hash was never taken cannot be hashed.
        self.leases: Dict[int, Tuple[int, int, "weakref.ReferenceType[Lease]"]] = {}
        self.returns: Deque["weakref.ReferenceType[Lease]"] = deque()
        self.released: Dict[int, int] = {}  # slot id -> bytes, of slots retired while leased
        self._next_id = 0
        self._closed = False
        self._watchers: List[Tuple[Callable[[int, int], None], Callable[[int, int], None]]] = []
        self.recent_spills: Deque[int] = deque(maxlen=max(keep, 2))  # overflow use of batches
        self.overflow_high = 0  # the largest overflow_bound of any slot (0: nothing held)

    # -- state changes ---------------------------------------------------------------------

    def _move(self, slot: Slot, to: SlotState) -> None:
        if to not in _ALLOWED[slot.state]:
            raise InternalError(
                f"{self.label}: slot {slot.slot_id} cannot go from {slot.state.value} to {to.value}"
            )
        if slot.state is SlotState.READY:
            self.ready -= 1
        elif slot.state is SlotState.DRAINING:
            self.draining -= 1
        if to is SlotState.READY:
            self.ready += 1
        elif to is SlotState.DRAINING:
            self.draining += 1
        slot.state = to

    def acquire(self, region_bytes: int, total_needed: int, batch_seq: int) -> Slot:
        """A slot for a new batch, now FILLING, with ``region_bytes`` of region memory reserved.

        Reuses a free slot, else creates one (and tells the workers). Raises
        :class:`~extsrc.errors.SharedMemoryError` when the memory cannot be
        had; the slot is then left FREE.
        """
        self._check_open()
        slot = next((s for s in self.slots.values() if s.state is SlotState.FREE), None)
        if slot is None:
            if len(self.slots) >= self.keep:
                self._release_held()
            slot = self._create()
        if region_bytes and (slot.region_map is None or slot.region_map.size < region_bytes):
            size = slot.region.reserve(region_bytes, total_needed)
            slot.region_map = self._watched(slot.region.map(size))  # an older one goes with its last user
        self._move(slot, SlotState.FILLING)
        slot.batch_seq = batch_seq
        return slot

    def _release_held(self) -> None:
        """The oldest slot the consumer holds leaves the pool (LEASED -> RETIRED), so that a
        new slot takes its place rather than adding to it. Its batch stays valid: the lease
        holds its mappings, not its descriptors. A consumer that keeps every batch thus holds
        memory, never descriptors, for them (its own and the workers'), and a slot beyond
        ``keep`` would be retired when freed anyway."""
        held = next((s for s in self.slots.values() if s.state is SlotState.LEASED), None)
        if held is not None:
            self.released[held.slot_id] = _nbytes(held)  # counted until its lease returns
            self._retire(held)

    def _released_to(self, slot: Slot, lease: Lease) -> bool:
        """Whether ``slot`` left the pool while leased to ``lease`` (its lease is still alive)."""
        return (slot.state is SlotState.RETIRED and slot.slot_id in self.released
                and lease.slot_id == slot.slot_id and slot.lease_seq == lease.seq)

    def _create(self) -> Slot:
        slot_id = self._next_id
        self._next_id += 1
        slot = Slot(slot_id, self.label, self.num_workers)
        try:
            self.link.add_slot(self.source_id, slot_id, slot.region.fd, [s.fd for s in slot.overflow])
        except BaseException:
            slot.close_segments()  # no worker knows of it
            raise
        self.slots[slot_id] = slot
        return slot

    def watch(self, on_map: Callable[[int, int], None], on_unmap: Callable[[int, int], None]) -> None:
        """Calls ``on_map(address, size)`` for every mapping of the slots, now and when made, and
        ``on_unmap(address, size)`` right before one is unmapped (e.g. to pin the memory for DMA).

        Lock held. The callbacks run in the thread that maps (the pool's or a consumer's) or the
        one that drops the last reference; they must be quick and must not raise.
        """
        self._watchers.append((on_map, on_unmap))
        for slot in self.slots.values():
            for mapping in (slot.region_map, *slot.overflow_maps):
                if mapping is not None:
                    on_map(mapping.address, mapping.size)
                    mapping.on_close.append(on_unmap)

    @property
    def watched(self) -> bool:
        """Whether :meth:`watch` was called (the memory may be page-locked for DMA)."""
        return bool(self._watchers)

    def _watched(self, mapping: Mapping) -> Mapping:
        for on_map, on_unmap in self._watchers:
            on_map(mapping.address, mapping.size)
            mapping.on_close.append(on_unmap)
        return mapping

    def filled(self, slot: Slot) -> None:
        """Every task of the slot's batch reported back: FILLING -> READY, DRAINING -> FREE."""
        self._move(slot, SlotState.FREE if slot.state is SlotState.DRAINING else SlotState.READY)

    def fit_overflow(self, slot: Slot, use: Dict[int, Optional[int]]) -> None:
        """Producer, lock held, once every task of ``slot``'s batch reported: ``use`` gives, per
        worker that answered, the overflow bytes its samples take (``None``: the task failed,
        what it wrote is unknown).

        A worker keeps the overflow of a slot it writes to at
        :data:`~extsrc.engine.policy.OVERFLOW_KEEP` times what the batch uses; this gives back
        the overflow of the slot's other workers past :data:`~extsrc.engine.policy.IDLE_OVERFLOW`
        (a slot written by each worker in turn would hold a batch's overflow for each), and,
        past ``OVERFLOW_KEEP`` times what the recent batches use, that of the other slots'
        workers that did not write their batch, which may not write to that slot again for long
        (or the slot may wait FREE): with ragged samples that shrink, memory follows the batches
        of now, whoever wrote them. Not once the memory is
        watched (see :attr:`watched`)."""
        writers = set()
        for worker, nbytes in use.items():
            if nbytes is None:  # its earlier samples may be the batch's (ended before the failure)
                writers.add(worker)
                slot.overflow_bound[worker] = _UNKNOWN
            elif nbytes:
                writers.add(worker)
                slot.overflow_bound[worker] = max(int(policy.OVERFLOW_KEEP * nbytes), policy.MIN_OVERFLOW)
        slot.writers = frozenset(writers)
        batch_use = max((n for n in use.values() if n), default=0)
        if self.watched or (not batch_use and not self.overflow_high):
            return  # page-locked memory stays (watched for good); or nothing spilled, nothing held
        self._give_back_overflow(slot, policy.IDLE_OVERFLOW)  # the slot's other workers'
        self.recent_spills.append(batch_use)
        self.overflow_high = max(self.overflow_high, *slot.overflow_bound)
        keep = max(int(policy.OVERFLOW_KEEP * max(self.recent_spills)), policy.MIN_OVERFLOW)
        if self.overflow_high > keep:
            self.overflow_high = max(self._give_back_overflow(s, keep) for s in self.slots.values())

    def _give_back_overflow(self, slot: Slot, keep: int) -> int:
        """Gives back the overflow ``slot`` holds past ``keep`` bytes in the segments nobody
        writes or reads now; returns the largest bound left."""
        if slot.state in (SlotState.FILLING, SlotState.DRAINING):
            return max(slot.overflow_bound)  # workers may be writing
        readers = slot.writers if slot.state is not SlotState.FREE else frozenset()
        for worker, bound in enumerate(slot.overflow_bound):
            if bound > keep and worker not in readers:
                slot.overflow[worker].give_back(keep)
                slot.overflow_bound[worker] = keep
        return max(slot.overflow_bound)

    def abandon(self, slot: Slot) -> None:
        """Nobody will take the slot's batch: READY -> FREE, FILLING -> DRAINING."""
        if slot.state is SlotState.READY:
            self._move(slot, SlotState.FREE)
        elif slot.state is SlotState.FILLING:
            self._move(slot, SlotState.DRAINING)

    def lease(self, slot: Slot, overflow_sizes: Dict[int, int]) -> Lease:
        """A lease over the READY slot's memory, for its next take; the slot's state is unchanged.

        ``overflow_sizes`` gives, per worker that wrote overflow, the bytes to
        map of its overflow segment (mapped once, then kept with the slot).
        The lease holds the slot only once :meth:`commit` ran for it; a lease
        that dies before is ignored. Raises ``InternalError`` unless READY.
        """
        if slot.state is not SlotState.READY:
            raise InternalError(f"{self.label}: slot {slot.slot_id} leased while {slot.state.value}")
        overflow: Dict[int, Mapping] = {}
        for worker, size in overflow_sizes.items():
            current = slot.overflow_maps[worker]
            if current is None or current.size < size:
                current = self._watched(slot.overflow[worker].map(size))
                slot.overflow_maps[worker] = current
            overflow[worker] = current
        lease = Lease(slot.slot_id, slot.lease_seq + 1, slot.region_map, overflow)
        lease.ref = weakref.ref(lease, self.returns.append)
        return lease

    def holds(self, slot: Slot, batch_seq: int, lease: Lease) -> bool:
        """Whether ``slot`` holds batch ``batch_seq`` for ``lease``: READY with ``lease`` its next
        lease (a commit would take it), or LEASED to ``lease`` already (a commit was applied)."""
        if slot.batch_seq != batch_seq:
            return False
        if self.slots.get(slot.slot_id) is not slot:
            # Retired while leased (_release_held): still the lease's, until the lease dies.
            return self._released_to(slot, lease)
        if slot.state is SlotState.READY:
            return slot.lease_seq in (lease.seq - 1, lease.seq)  # the second: a commit cut short
        return slot.state is SlotState.LEASED and slot.lease_seq == lease.seq

    def commit(self, slot: Slot, lease: Lease) -> None:
        """READY -> LEASED to ``lease`` (from :meth:`lease`; only if :meth:`holds`).

        Idempotent, and safe to run again after an interrupt anywhere in it:
        every step is an assignment, and the state changes last. The lease
        starts holding the memory in forked children too (see :mod:`extsrc.forking`).
        """
        if (slot.state is SlotState.LEASED and slot.lease_seq == lease.seq) or self._released_to(slot, lease):
            return
        assert lease.ref is not None, "a lease committed before lease() made its reference"
        self.leases[id(lease.ref)] = (slot.slot_id, lease.seq, lease.ref)
        for mapping in lease.mappings:
            mapping.leased = True
        slot.lease_generation = forking.generation()
        slot.lease_seq = lease.seq
        self._move(slot, SlotState.LEASED)

    def take(self, slot: Slot, overflow_sizes: Dict[int, int]) -> Lease:
        """:meth:`lease` and :meth:`commit` in one (READY -> LEASED), where nothing can interrupt
        in between that matters (tests, tools)."""
        lease = self.lease(slot, overflow_sizes)
        self.commit(slot, lease)
        return lease

    def process_returns(self) -> None:
        """Applies the leases that ended since the last call: LEASED -> FREE (or retired)."""
        while self.returns:
            slot_id, seq, _ref = self.leases.pop(id(self.returns.popleft()), (-1, -1, None))
            slot = self.slots.get(slot_id)
            if slot is None:
                self.released.pop(slot_id, None)  # retired while leased: its memory is gone now
                continue
            if slot.state is not SlotState.LEASED or slot.lease_seq != seq:
                continue  # the lease of a take that was never applied
            self._move(slot, SlotState.FREE)
            if slot.lease_generation != forking.generation() or slot.retire_when_free:
                # A child forked while it was held may still read it; or it holds overflow
                # memory no later batch needs.
                self._retire(slot)
                continue
            for mapping in (slot.region_map, *slot.overflow_maps):
                if mapping is not None:
                    mapping.leased = False

    def keep_at_least(self, keep: int) -> None:
        """Producer, lock held: lets up to ``keep`` slots stay allocated (never fewer than now)."""
        self.keep = max(self.keep, keep)

    def trim(self) -> None:
        """Retires free slots while more than ``keep`` slots are allocated."""
        excess = len(self.slots) - self.keep
        if excess <= 0:
            return
        for slot in [s for s in self.slots.values() if s.state is SlotState.FREE][:excess]:
            self._retire(slot)

    def _retire(self, slot: Slot) -> None:
        self._move(slot, SlotState.RETIRED)
        del self.slots[slot.slot_id]
        slot.close_segments()
        slot.region_map = None
        slot.overflow_maps = []
        if not self._closed:
            self.link.drop_slot(self.source_id, slot.slot_id)

    # -- queries ---------------------------------------------------------------------------

    @property
    def waits_for_drain(self) -> bool:
        """Whether a new batch would take the place of a slot the consumer holds (no slot FREE,
        ``keep`` of them allocated) while an abandoned batch's slot drains, which gives a free
        one back soon: the batch is better dispatched then than made in new memory."""
        return bool(self.draining) and len(self.slots) >= self.keep and not any(
            s.state is SlotState.FREE for s in self.slots.values())

    @property
    def held(self) -> int:
        """Batches the consumer holds now (leased slots whose lease lives)."""
        if self._closed:
            return len(self._alive_leases())
        return len(self.leases) - len(self.returns)

    def _alive_leases(self) -> Set[int]:
        """After :meth:`close`, where no thread applies returns: the ids of the slots whose lease
        still lives (a lease that ended is seen by its dead reference)."""
        return {slot_id for slot_id, _, ref in self.leases.values() if ref() is not None}

    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.slots.values() if s.state is state)

    def capacities(self) -> List[int]:
        """Shared memory each slot holds now (region and overflow segments), in bytes, by slot
        id; slots retired while the consumer still holds their batch included. Empty after
        :meth:`close`: the pool holds no slot then."""
        if self._closed:
            return []
        sizes = {slot_id: _nbytes(slot) for slot_id, slot in self.slots.items()}
        sizes.update(self.released)
        return [size for _, size in sorted(sizes.items())]

    def reserved_bytes(self) -> int:
        """Shared memory the slots hold now (region and overflow segments), in bytes; slots
        retired while the consumer still holds their batch included, after :meth:`close` too
        (until the batch is dropped)."""
        if self._closed:
            alive = self._alive_leases()
            return sum(size for slot_id, size in self.released.items() if slot_id in alive)
        return sum(_nbytes(slot) for slot in self.slots.values()) + sum(self.released.values())

    def _check_open(self) -> None:
        if self._closed:
            raise InternalError(f"{self.label}: slot pool used after close()")

    # -- end -------------------------------------------------------------------------------

    def close(self, tell_workers: bool) -> None:
        """Gives back all memory no lease holds, at once; held batches keep theirs until dropped.

        Idempotent. ``tell_workers``: the workers live on (a source closed on
        a shared pool) and are told to drop the slots; otherwise they have
        stopped already.
        """
        if self._closed:
            return
        for slot in list(self.slots.values()):
            if slot.state is SlotState.LEASED:
                self.released[slot.slot_id] = _nbytes(slot)  # counted until its lease ends
            if tell_workers:
                self.link.drop_slot(self.source_id, slot.slot_id)
            slot.close_segments()
            slot.region_map = None
            slot.overflow_maps = []
            slot.state = SlotState.RETIRED
        self._closed = True
        self.slots.clear()
        self.returns.clear()  # the leases and what they hold stay: see reserved_bytes()
