"""What a Ray actor answers the pool, besides the engine's own records.

A task comes back as the engine's :class:`~extsrc.engine.protocol.TaskDone`
when the actor runs on the consumer's node and wrote the samples into the
slot itself (it opened the slot's descriptors, :class:`SlotOpen`), else as
a :class:`Produced` (the checked samples themselves, through Ray), which the
pool writes into the slot and hands its source as a ``TaskDone``; or as the
engine's :class:`~extsrc.engine.protocol.TaskFailed`. The samples of a small answer
travel as :class:`Piece` s in the call's further return values (see
:mod:`extsrc.ray.parts`). An actor answers its first call, ``ready()``, with
an :class:`ActorReady` (where it runs), or with the engine's
:class:`~extsrc.engine.protocol.SetupFailed` when it could not load the
sources.

An actor on the consumer's node is then asked to ``serve()`` the pool over a
Unix socket, as a worker process does (see :mod:`extsrc.ray.backend`): it
connects, says :data:`HELLO` (the pool's token, its index), and from then on tasks, slots
(:class:`~extsrc.engine.protocol.AddSlot` with its descriptors) and answers
travel as the engine's messages on that socket, not as Ray calls. ``serve()``
answers :class:`ChannelOpened` when the channel closes, or at once when it
could not connect (the pool then goes on with Ray calls).
"""

from __future__ import annotations

import struct
from typing import Any, List, NamedTuple, Tuple, Union

import numpy as np

# One output's samples of a piece: one array with the samples along its first axis when they
# share dtype and shape (and are small, see extsrc.ray.actor.STACK_MAX_SAMPLE_BYTES), else a
# list of sample arrays.
PieceColumns = Union[np.ndarray, List[np.ndarray]]


class Produced(NamedTuple):
    """Samples ``start .. start + count - 1`` of a task, checked.

    ``pieces``: the samples as the runner added them, in order, each
    ``(position, count, columns)`` with ``columns[j]`` output ``j``'s samples
    ``position .. position + count - 1``. Empty in a call's first return
    value when the call has parts: they then come as :class:`Piece` s. The
    ``ObjectRef`` of that tuple when the actor put a large answer into Ray's
    object store (see :meth:`extsrc.ray.actor.PackedWrite.answer`).
    ``stopped``: the epoch ended right after them.
    """

    source_id: int
    ticket: int
    start: int
    count: int  # type: ignore[assignment]  # shadows tuple.count, never called on these
    stopped: bool
    pieces: Any  # Tuple[Tuple[int, int, Tuple[PieceColumns, ...]], ...], or its ObjectRef
    busy_ns: int = 0  # the actor's time on the task, and the callback's per group of samples
    timed: Tuple[Tuple[int, int], ...] = ()  # (samples, ns), as in TaskDone (statistics)
    notes: Tuple[str, ...] = ()  # warnings for the user, as in TaskDone
    faults: Tuple[Any, ...] = ()  # samples replaced by on_error, as in TaskDone


class Piece(NamedTuple):
    """Samples ``position .. position + count - 1`` of answer ``answer`` of the call (its index
    in the call's first return value), one entry per output."""

    answer: int
    position: int
    count: int  # type: ignore[assignment]  # shadows tuple.count, never called on these
    columns: Tuple[PieceColumns, ...]


class ActorReady(NamedTuple):
    """Where actor ``index`` runs: Ray's ids for it and its node, the node's address, the pid."""

    index: int  # type: ignore[assignment]  # shadows tuple.index, never called on these
    actor_id: str
    node_id: str
    node_ip: str
    hostname: str
    pid: int


class SlotOpen(NamedTuple):
    """A new slot of a source, for an actor on the consumer's node: its descriptors as the
    consumer's process ``pid`` holds them (numbers ``region_fd`` and ``overflow_fd``, the
    latter the actor's own overflow segment), kept open by the pool until the call that
    carries this record has answered; the actor opens them as ``/proc/<pid>/fd/<n>`` and
    uses them only if they are the files named by ``region_file`` and ``overflow_file``."""

    source_id: int
    slot_id: int
    kind: str  # the segments' backend ("memfd", "devshm"), for error messages
    pid: int
    region_fd: int
    overflow_fd: int
    # (st_dev, st_ino) of each segment: the actor checks that what it opened is the slot's
    # memory, not a file of another process that happens to have this pid where it runs.
    region_file: Tuple[int, int] = (0, 0)
    overflow_file: Tuple[int, int] = (0, 0)


class SlotClose(NamedTuple):
    """The slot is retired: an actor that opened it closes and unmaps it."""

    source_id: int
    slot_id: int


SlotChange = Union[SlotOpen, SlotClose]


# Actor -> pool, the first bytes on a direct channel, before any pickled message: the token the
# pool gave it (another process of the host that connects has none, and nothing it sends is
# unpickled) and the worker's index.
TOKEN_BYTES = 16
HELLO = struct.Struct(f"<{TOKEN_BYTES}sI")


class ChannelOpened(NamedTuple):
    """``serve()``'s answer: ``connected`` when the channel was open (it closed since), else
    why the actor could not connect."""

    connected: bool
    reason: str = ""
