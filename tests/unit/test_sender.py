"""Unit tests: a worker's answers go at once, or after a short task with two more waiting,
held back and sent together with the next one; a held answer never waits for long."""

import select
import time

from extsrc.engine.channel import Channel
from extsrc.engine.protocol import Task, TaskDone
from extsrc.engine.sender import SHORT_TASK_S, ResultSender

LONG_HOLD_S = 3600.0  # the helper thread never sends within a test
DEADLINE_S = 30.0  # generous: only a broken sender waits this long


def task(ticket):
    return Task(0, ticket, 0, ticket, 0, ticket, 0, 4, 64, ())


def done(ticket):
    return TaskDone(0, ticket, 0, 4, False, ((),), 0)


def answers(pool_end, count, deadline_s=DEADLINE_S):
    got, deadline = [], time.monotonic() + deadline_s
    while len(got) < count and time.monotonic() < deadline:
        select.select([pool_end], [], [], 0.5)
        got += pool_end.recv_available()
    return [m.ticket for m in got]


def pair_with_tasks_waiting(count):
    pool_end, worker_end = Channel.pair()
    pool_end.send_many([task(t) for t in range(count)])
    deadline = time.monotonic() + DEADLINE_S
    while worker_end.waiting() < min(count, 2) and time.monotonic() < deadline:
        select.select([worker_end], [], [], 0.1)
    return pool_end, worker_end


def test_a_short_task_with_two_waiting_is_answered_with_the_next_in_one_write():
    pool_end, worker_end = pair_with_tasks_waiting(2)
    sender = ResultSender(worker_end, hold_max_s=LONG_HOLD_S)
    try:
        sender.deliver(done(0), task_s=0.0)
        assert sender.holding
        assert pool_end.recv_available() == []  # nothing sent yet
        sender.deliver(done(1), task_s=0.0)
        assert not sender.holding
        assert answers(pool_end, 2) == [0, 1]
    finally:
        sender.close()
        pool_end.close()
        worker_end.close()


def test_answers_go_at_once_after_a_long_task_or_with_fewer_than_two_waiting():
    for waiting, task_s in ((1, 0.0), (0, 0.0), (2, SHORT_TASK_S * 2)):
        pool_end, worker_end = pair_with_tasks_waiting(waiting)
        sender = ResultSender(worker_end, hold_max_s=LONG_HOLD_S)
        try:
            sender.deliver(done(0), task_s=task_s)
            assert not sender.holding, (waiting, task_s)
            assert answers(pool_end, 1) == [0]
        finally:
            sender.close()
            pool_end.close()
            worker_end.close()


def test_flush_sends_the_held_answer():
    pool_end, worker_end = pair_with_tasks_waiting(2)
    sender = ResultSender(worker_end, hold_max_s=LONG_HOLD_S)
    try:
        sender.deliver(done(0), task_s=0.0)
        assert sender.holding
        sender.flush()
        assert not sender.holding and answers(pool_end, 1) == [0]
        sender.flush()  # nothing held: nothing sent
        assert pool_end.recv_available() == []
    finally:
        sender.close()
        pool_end.close()
        worker_end.close()


def test_an_answer_held_while_the_next_task_hangs_is_sent_by_the_helper():
    # The worker's loop does not come back (its next task hangs): the answer must still go.
    pool_end, worker_end = pair_with_tasks_waiting(2)
    sender = ResultSender(worker_end, hold_max_s=0.01)
    try:
        sender.deliver(done(0), task_s=0.0)
        assert answers(pool_end, 1) == [0]
        assert not sender.holding
    finally:
        sender.close()
        pool_end.close()
        worker_end.close()
