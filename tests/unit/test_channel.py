"""Unit tests: the framed channel between pool and worker, descriptors included."""

import os
import select
import threading

import pytest

from extsrc.engine.channel import Channel, OwnedFds
from extsrc.engine.protocol import AddSlot, Task, TaskDone


def test_messages_arrive_whole_in_order_and_several_at_a_time():
    pool_end, worker_end = Channel.pair()
    try:
        for ticket in range(50):
            worker_end.send(TaskDone(0, ticket, 1, 4, False, ((),), 0))
        got = []
        while len(got) < 50:
            got += pool_end.recv_available()
        assert [m.ticket for m in got] == list(range(50)) and all(isinstance(m, TaskDone) for m in got)
        assert pool_end.recv_available() == []  # nothing waiting: no block
    finally:
        pool_end.close()
        worker_end.close()


def test_messages_longer_than_a_read_arrive_whole_between_short_ones():
    # The pool end reads into a buffer of its own: a message longer than it, or cut between
    # two reads, must come out whole, and the short ones around it in their order.
    pool_end, worker_end = Channel.pair()
    sizes = [10, 100_000, 5, 300_000, 70_000, 1, 65_530, 2]
    payloads = [bytes([k]) * n for k, n in enumerate(sizes)]
    sender = threading.Thread(target=lambda: [worker_end.send(p) for p in payloads])
    sender.start()
    try:
        got = []
        while len(got) < len(payloads):
            select.select([pool_end], [], [], 5.0)
            got += pool_end.recv_available()
        assert [len(m) for m in got] == sizes and got == payloads
        worker_end.send(b"after")  # and the buffer serves the next message as before
        while not (more := pool_end.recv_available()):
            select.select([pool_end], [], [], 5.0)
        assert more == [b"after"]
    finally:
        sender.join(10)
        pool_end.close()
        worker_end.close()


def test_descriptors_travel_with_their_message():
    pool_end, worker_end = Channel.pair()
    read, write = os.pipe()
    try:
        fds = OwnedFds((read, write))
        pool_end.send(AddSlot(0, 3, "memfd"), fds.fds)
        fds.close()
        pool_end.send(Task(0, 1, 3, 0, 0, 0, 0, 4, 0, (None,)))
        message, received = worker_end.recv()
        assert message == AddSlot(0, 3, "memfd") and len(received) == 2
        os.write(received[1], b"x")
        assert os.read(received[0], 1) == b"x"
        for fd in received:
            os.close(fd)
        message, received = worker_end.recv()
        assert isinstance(message, Task) and received == []
    finally:
        for fd in (read, write):
            os.close(fd)
        pool_end.close()
        worker_end.close()


def test_a_closed_peer_is_an_eof():
    pool_end, worker_end = Channel.pair()
    worker_end.close()
    with pytest.raises(EOFError):
        pool_end.recv_available()
    pool_end.close()
