"""Unit tests: the framed channel between pool and worker, descriptors included."""

import os
import pickle
import select
import threading

import pytest

from extsrc.engine.channel import Channel, OwnedFds
from extsrc.engine.protocol import AddSlot, Task, TaskDone, from_wire, to_wire


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
        pool_end.send(Task(0, 1, 3, 0, 0, 0, 0, 4, 0, True, (None,)))
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


def _task(ticket):
    return Task(0, ticket, 0, ticket, 0, ticket, 0, 4, 64, True, ())


def test_several_messages_sent_in_one_write_arrive_whole_and_in_order():
    pool_end, worker_end = Channel.pair()
    try:
        pool_end.send_many([_task(t) for t in range(5)])
        assert [worker_end.recv()[0].ticket for _ in range(5)] == list(range(5))
        worker_end.send_many([TaskDone(0, t, 0, 4, False, ((),), 0) for t in (7, 8)])
        got = []
        while len(got) < 2:
            select.select([pool_end], [], [], 5.0)
            got += pool_end.recv_available()
        assert [m.ticket for m in got] == [7, 8]
    finally:
        pool_end.close()
        worker_end.close()


def test_the_worker_end_hands_out_messages_one_read_brought_one_by_one():
    # One read takes every message there is; an event loop watching the socket is not told
    # of those after the first, so the channel says it has them (buffered()).
    pool_end, worker_end = Channel.pair()
    try:
        assert not worker_end.buffered()
        pool_end.send_many([_task(t) for t in range(3)])
        select.select([worker_end], [], [], 5.0)
        assert worker_end.recv()[0].ticket == 0
        assert worker_end.buffered()
        assert [worker_end.recv()[0].ticket for _ in range(2)] == [1, 2]
        assert not worker_end.buffered()
        # Part of a message is not a message; the rest completes it.
        payload = pickle.dumps(_task(3), protocol=pickle.HIGHEST_PROTOCOL)
        frame = len(payload).to_bytes(4, "little") + b"\0" + payload
        pool_end.sock.sendall(frame[:7])
        got = []
        reader = threading.Thread(target=lambda: got.append(worker_end.recv()[0]))
        reader.start()
        reader.join(0.2)
        assert not got  # waiting for the rest
        pool_end.sock.sendall(frame[7:])
        reader.join(30)
        assert [m.ticket for m in got] == [3]
    finally:
        pool_end.close()
        worker_end.close()


def test_descriptors_keep_to_their_message_among_messages_read_together():
    # The worker end reads whatever is there at once: each message's descriptors must still
    # come out with that message, whichever read brought them.
    pool_end, worker_end = Channel.pair()
    pipes = [os.pipe() for _ in range(3)]
    try:
        for k, (read, write) in enumerate(pipes):
            pool_end.send_many([_task(10 * k), _task(10 * k + 1)])
            fds = OwnedFds((read, write))
            pool_end.send(AddSlot(0, k, "memfd"), fds.fds)
            fds.close()
        pool_end.send(_task(99))
        select.select([worker_end], [], [], 5.0)
        for k, (read, _write) in enumerate(pipes):
            for ticket in (10 * k, 10 * k + 1):
                message, received = worker_end.recv()
                assert message.ticket == ticket and received == []
            message, received = worker_end.recv()
            assert message == AddSlot(0, k, "memfd") and len(received) == 2
            os.write(received[1], bytes([k]))
            assert os.read(read, 1) == bytes([k])  # the duplicate of this message's pipe
            for fd in received:
                os.close(fd)
        message, received = worker_end.recv()
        assert message.ticket == 99 and received == [] and not worker_end.buffered()
    finally:
        for pair in pipes:
            for fd in pair:
                os.close(fd)
        pool_end.close()
        worker_end.close()


def test_the_worker_end_sees_the_pool_end_close():
    pool_end, worker_end = Channel.pair()
    pool_end.send(_task(1))
    pool_end.close()
    assert worker_end.recv()[0].ticket == 1  # what came before the end is read first
    with pytest.raises(EOFError):
        worker_end.recv()
    worker_end.close()


def test_tasks_and_their_answers_cross_whole_with_their_types():
    # They travel as plain tuples (see extsrc.engine.protocol.to_wire); they must come out as
    # the records that went in, nested regions and spilled samples included.
    from extsrc.shm.layout import Region, Spilled

    task = Task(3, 77, 5, 9, 1, 12, 0, 256, 4096, True, (Region(0, "|u1", (16,)), None))
    done = TaskDone(3, 77, 1, 256, True, ((Spilled(4, "<f4", (2, 3), 64),), ()), 128, 5,
                    ((256, 9),), 6, 7, 8, ("a note",))
    pool_end, worker_end = Channel.pair()
    try:
        pool_end.send_many([task, AddSlot(3, 5, "memfd")])
        first, _ = worker_end.recv()
        second, _ = worker_end.recv()
        worker_end.send(done)
        got = []
        while not got:
            select.select([pool_end], [], [], 5.0)
            got = pool_end.recv_available()
    finally:
        pool_end.close()
        worker_end.close()
    assert (first, second, got) == (task, AddSlot(3, 5, "memfd"), [done])
    assert type(first) is Task and type(first.regions[0]) is Region and type(got[0]) is TaskDone
    assert type(got[0].spilled[0][0]) is Spilled
    # A spilled sample (one per ragged sample) goes as a plain tuple, not as a record to rebuild.
    assert b"Spilled" not in pickle.dumps(to_wire(done), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)) > len(
        pickle.dumps(to_wire(task), protocol=pickle.HIGHEST_PROTOCOL))


def test_a_message_of_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown kind.*tag 99"):
        from_wire((99, 1, 2))


def test_messages_that_fill_a_read_exactly_are_handed_out_before_the_end():
    # A read that fills the pool end's buffer is followed by another; when that one finds the
    # worker gone, the whole messages of the first still count (a worker's last answers).
    from extsrc.engine import channel as channel_module

    payload = b"x" * (channel_module._READ_CHUNK - len(channel_module._frame(b"x" * 1000, 0)) + 1000)
    assert len(channel_module._frame(payload, 0)) == channel_module._READ_CHUNK
    pool_end, worker_end = Channel.pair()
    try:
        worker_end.send(payload)
        worker_end.close()
        assert pool_end.recv_available() == [payload]
        with pytest.raises(EOFError, match="closed by its peer"):
            pool_end.recv_available()
    finally:
        pool_end.close()
