"""extsrc.ray.parts: an actor's answer cut into return values small enough for Ray's reply,
and put back together in order. Needs no Ray."""

from __future__ import annotations

import numpy as np
import pytest

from extsrc.engine.protocol import TaskFailed
from extsrc.ray.parts import INLINE_MAX_BYTES, PART_BYTES, columns_bytes, fitting, join, parts_for, split
from extsrc.ray.protocol import Produced


def produced(ticket, start, count, sample_bytes, pieces=1, ragged=False):
    """A Produced of ``count`` uint8 samples numbered from ``start``, added in ``pieces`` chunks."""
    chunks = []
    bounds = np.linspace(start, start + count, pieces + 1).astype(int)
    for a, b in zip(bounds[:-1], bounds[1:]):
        rows = [np.full(sample_bytes + ((k % 7) * 300 if ragged else 0), k % 251, np.uint8)
                for k in range(a, b)]
        column = rows if ragged else np.stack(rows)
        labels = np.arange(a, b, dtype=np.int64)
        chunks.append((int(a), int(b - a), (column, labels)))
    return Produced(0, ticket, start, count, False, tuple(chunks))


def samples(answer):
    """Every sample of ``answer`` as (position, output 0 bytes, output 1 value), in order."""
    out = []
    for position, count, (column, labels) in answer.pieces:
        assert len(column) == count and len(labels) == count
        for k in range(count):
            out.append((position + k, bytes(np.asarray(column[k])), int(labels[k])))
    return out


def test_nothing_known_or_a_large_answer_travels_whole():
    assert parts_for(0) == 0
    assert parts_for(INLINE_MAX_BYTES + 1) == 0
    assert parts_for(1) == 1
    assert parts_for(256 << 10) >= (256 << 10) // PART_BYTES + 1


@pytest.mark.parametrize("ragged", [False, True])
def test_answers_come_back_whole_and_in_order_with_every_part_under_the_limit(ragged):
    answers = [produced(7, 0, 256, 1024, ragged=ragged),
               TaskFailed(0, 8, 1, 3, None, None, "ValueError", "bad", "tb", True),
               produced(9, 256, 100, 1500, pieces=3, ragged=ragged)]
    expected_bytes = sum(columns_bytes(c) for a in answers if isinstance(a, Produced)
                         for _, _, c in a.pieces)
    parts = parts_for(expected_bytes) + 1  # room for the cuts' rounding
    assert fitting(answers, parts) == 3
    heads, *bins = split(answers, parts)
    assert len(bins) == parts
    assert all(h.pieces == () for h in heads if isinstance(h, Produced))
    for part in bins:
        assert sum(columns_bytes(piece.columns) for piece in part) <= PART_BYTES
    back = join(heads, bins)
    assert back[1] == answers[1]
    for ours, theirs in ((back[0], answers[0]), (back[2], answers[2])):
        assert ours._replace(pieces=()) == theirs._replace(pieces=())
        assert samples(ours) == samples(theirs)


def test_answers_beyond_the_parts_asked_for_wait_for_the_next_call():
    answers = [produced(k, 256 * k, 256, 1024) for k in range(3)]
    one = sum(columns_bytes(c) for _, _, c in answers[0].pieces)
    assert fitting(answers, parts_for(2 * one) + 1) == 2
    assert fitting(answers, 1) == 1  # the first goes whatever its size
    assert fitting([], 3) == 0


def test_more_than_expected_goes_in_the_last_part_and_nothing_is_lost():
    answer = produced(1, 0, 512, 1024)  # ~512 KiB where one part was expected
    heads, *bins = split([answer], 2)
    assert len(bins) == 2 and columns_bytes(bins[0][0].columns) <= PART_BYTES
    assert samples(join(heads, bins)[0]) == samples(answer)


def test_a_sample_larger_than_a_part_goes_alone_and_unused_parts_travel_empty():
    answer = produced(1, 0, 3, PART_BYTES * 2)
    heads, *bins = split([answer], 5)
    assert [sum(p.count for p in part) for part in bins[:3]] == [1, 1, 1]
    assert bins[3] == [] and bins[4] == []
    assert samples(join(heads, bins)[0]) == samples(answer)
