"""The pool's queue of unsent tasks: each source's in order, the sources served in turn."""

from extsrc.engine.fair_queue import FairQueue
from extsrc.engine.protocol import Task


def task(source_id: int, ticket: int) -> Task:
    return Task(source_id, ticket, 0, ticket, 0, ticket, 0, 1, 0, False, ())


def taken(queue: FairQueue, allowed=lambda t: True) -> list:
    out = []
    while True:
        t = queue.take(allowed)
        if t is None:
            return out
        out.append((t.source_id, t.ticket))


def test_a_source_queued_first_does_not_keep_a_later_one_behind_all_its_tasks():
    queue = FairQueue()
    for ticket in range(4):
        queue.append(task(0, ticket))
    queue.append(task(1, 10))
    queue.append(task(1, 11))
    assert taken(queue) == [(0, 0), (1, 10), (0, 1), (1, 11), (0, 2), (0, 3)]
    assert not queue and len(queue) == 0


def test_a_source_that_may_not_go_deeper_lets_the_next_one_go():
    queue = FairQueue()
    queue.append(task(0, 0))
    queue.append(task(1, 1))
    assert taken(queue, lambda t: t.source_id != 0) == [(1, 1)]
    assert taken(queue) == [(0, 0)]


def test_tasks_put_back_come_first_in_their_order():
    queue = FairQueue()
    queue.append(task(0, 5))
    queue.append(task(1, 6))
    queue.put_back([task(1, 1), task(0, 2), task(1, 3)])
    assert taken(queue) == [(1, 1), (0, 2), (1, 3), (0, 5), (1, 6)]


def test_removing_a_source_returns_its_tasks_in_order_and_keeps_the_others():
    queue = FairQueue()
    for ticket, source in enumerate((0, 1, 0, 1)):
        queue.append(task(source, ticket))
    assert [t.ticket for t in queue.remove_source(0)] == [0, 2]
    assert queue.remove_source(7) == []
    assert taken(queue) == [(1, 1), (1, 3)]
