"""What a Ray actor answers the pool, besides the engine's own records.

A task comes back as a :class:`Produced` (the checked samples themselves,
through Ray's object store) or as the engine's
:class:`~extsrc.engine.protocol.TaskFailed`; the pool writes a ``Produced``
into the slot and hands its source an ordinary
:class:`~extsrc.engine.protocol.TaskDone`. An actor answers its first call,
``ready()``, with an :class:`ActorReady` (where it runs), or with the
engine's :class:`~extsrc.engine.protocol.SetupFailed` when it could not load
the sources.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Tuple


class Produced(NamedTuple):
    """Samples ``start .. start + count - 1`` of a task, checked, one entry per output.

    ``columns[j]`` is one array with the samples along its first axis when
    they share dtype and shape (and are small, see
    :data:`extsrc.ray.actor.STACK_MAX_SAMPLE_BYTES`), else a list of sample
    arrays. ``stopped``: the epoch ended right after them.
    """

    source_id: int
    ticket: int
    start: int
    count: int
    stopped: bool
    columns: Tuple[Any, ...]
    busy_ns: int = 0  # the actor's time on the task, and the callback's per group of samples
    timed: Tuple[Tuple[int, int], ...] = ()  # (samples, ns), as in TaskDone (statistics)


class ActorReady(NamedTuple):
    """Where actor ``index`` runs: Ray's ids for it and its node, the node's address, the pid."""

    index: int
    actor_id: str
    node_id: str
    node_ip: str
    hostname: str
    pid: int
