"""How an actor's answer travels: in Ray's reply itself when it is small enough.

Ray hands a call's return value back in the reply to the call when its
serialised size is below ``max_direct_call_object_size`` (100 KiB unless the
cluster was started with another); a larger one goes through the node's
shared-memory object store: the actor creates and seals it there, the raylet
pins it, the caller maps and releases it. For a batch of a few hundred KiB
those steps cost more than the call itself (on 2 cores they took a third of
the CPU per batch of 256 small samples). So a call whose answer is expected
to be small is sent with ``1 + parts`` return values
(:func:`parts_for`): the first holds the answers
(:class:`~extsrc.ray.protocol.Produced` without their samples), the others
the samples, cut into :class:`~extsrc.ray.protocol.Piece` s of contiguous
samples that each fit under Ray's limit (:func:`split`, in the actor). The
pool puts them back together (:func:`join`) before writing them into the
slot, piece by piece, as a worker process adds its chunks.

The estimate comes from what the source's samples weighed so far; when it is
wrong nothing breaks: pieces that do not fit go in the last part (which Ray
then stores in the object store), and parts left over travel empty.
"""

from __future__ import annotations

import math
from typing import Any, List, Sequence, Tuple, TypeGuard, Union

import numpy as np

from extsrc.engine import TaskFailed
from extsrc.ray.protocol import Piece, PieceColumns, Produced

# What one part may weigh, below Ray's default inline limit of 100 KiB with room for the
# serialised records around the arrays.
PART_BYTES = 88 << 10
# What Ray's serialisation adds per array (its pickled header, dtype and shape), counted
# against PART_BYTES so that parts of many small arrays stay under the limit too.
ARRAY_OVERHEAD_BYTES = 256
# Answers expected above this travel through the object store as one value: past a few
# MiB, copying through the reply (into the message, through the socket, out of it) costs
# more than the object store's fixed steps, and Ray caps what a reply may inline (10 MiB).
INLINE_MAX_BYTES = 1 << 20

Answer = Union[Produced, TaskFailed]


def parts_for(expected_bytes: float) -> int:
    """How many parts a call whose samples are expected to weigh ``expected_bytes`` asks for:
    0 (its answer travels as one value) when nothing is known yet or it is large."""
    if expected_bytes <= 0 or expected_bytes > INLINE_MAX_BYTES:
        return 0
    return max(1, math.ceil(expected_bytes / PART_BYTES))


def columns_bytes(columns: Sequence[PieceColumns]) -> int:
    """What samples ``columns`` (per output, an array of samples or a list of them) weigh in
    transit, overhead per array included."""
    total = 0
    for column in columns:
        if isinstance(column, np.ndarray):
            total += column.nbytes + ARRAY_OVERHEAD_BYTES
        else:
            total += sum(sample.nbytes for sample in column) + ARRAY_OVERHEAD_BYTES * len(column)
    return total


def split(answers: List[Answer], parts: int) -> Tuple[Any, ...]:
    """Actor: the call's ``1 + parts`` return values for ``answers``: the answers without their
    samples, then ``parts`` lists of :class:`Piece`, in sample order, each of up to
    :data:`PART_BYTES` (the last takes whatever is left: see :func:`fitting`)."""
    bins, _ = _pack(answers, parts)
    heads = [answer._replace(pieces=()) if _inline(answer) else answer for answer in answers]
    return (heads, *bins)


def fitting(answers: Sequence[Answer], parts: int) -> int:
    """Actor: how many of ``answers``, from the first, fit in ``parts`` parts of up to
    :data:`PART_BYTES` each (at least one, which travels whatever its size); the others wait for
    the next call. Every part of a call costs about as much as a small call's fixed work, so
    the pool asks for no more than it expects to fill."""
    for count in range(len(answers), 1, -1):
        if not _pack(answers[:count], parts)[1]:
            return count
    return min(1, len(answers))


def _inline(answer: Answer) -> TypeGuard[Produced]:
    """Whether ``answer``'s samples travel in parts (not a failure, not in the object store)."""
    return isinstance(answer, Produced) and isinstance(answer.pieces, tuple)


def _pack(answers: Sequence[Answer], parts: int) -> Tuple[List[List[Piece]], bool]:
    """The pieces of ``answers`` in ``parts`` bins, in order, a bin filled up to PART_BYTES before
    the next; and whether the last had to take more."""
    bins: List[List[Piece]] = [[] for _ in range(parts)]
    current, used, over = 0, 0, False
    for index, answer in enumerate(answers):
        if not _inline(answer):
            continue
        for position, count, columns in answer.pieces:
            for piece in _cut(index, position, count, columns):
                size = columns_bytes(piece.columns)
                if used and used + size > PART_BYTES:
                    if current < parts - 1:
                        current, used = current + 1, 0
                    else:
                        over = True
                bins[current].append(piece)
                used += size
    return bins, over


def join(heads: List[Answer], bins: Sequence[List[Piece]]) -> List[Answer]:
    """Pool: the answers of a call sent with parts, with their samples back in place."""
    pieces: List[List[Tuple[int, int, Tuple[PieceColumns, ...]]]] = [[] for _ in heads]
    for part in bins:
        for piece in part:
            pieces[piece.answer].append((piece.position, piece.count, piece.columns))
    return [head._replace(pieces=tuple(pieces[k])) if pieces[k] and isinstance(head, Produced) else head
            for k, head in enumerate(heads)]


def _cut(index: int, position: int, count: int, columns: Tuple[PieceColumns, ...]) -> List[Piece]:
    """Samples ``position .. position + count - 1`` as pieces of up to :data:`PART_BYTES`
    (a sample larger than that is a piece of its own)."""
    if columns_bytes(columns) <= PART_BYTES or count == 1:
        return [Piece(index, position, count, columns)]
    fixed = ARRAY_OVERHEAD_BYTES * sum(isinstance(c, np.ndarray) for c in columns)
    if fixed == ARRAY_OVERHEAD_BYTES * len(columns):  # every output stacked: rows weigh the same
        row = sum(c.nbytes for c in columns if isinstance(c, np.ndarray)) // count
        step = max(1, (PART_BYTES - fixed) // max(1, row))
        bounds = list(range(0, count, step)) + [count]
    else:
        bounds, used = [0], fixed
        for k in range(count):
            size = sum(c[k].nbytes if isinstance(c, np.ndarray) else c[k].nbytes + ARRAY_OVERHEAD_BYTES
                       for c in columns)
            if used + size > PART_BYTES and k > bounds[-1]:
                bounds.append(k)
                used = fixed
            used += size
        bounds.append(count)
    return [Piece(index, position + a, b - a, tuple(c[a:b] for c in columns))
            for a, b in zip(bounds[:-1], bounds[1:])]
