"""The pool's waker: a pending wake-up writes nothing more, and none is ever lost."""

import os
import select

from extsrc.engine import workers
from extsrc.engine.workers import Waker


def _readable(waker: Waker) -> bool:
    return bool(select.select([waker.fileno()], [], [], 0)[0])


def test_wake_ups_while_one_is_pending_write_one_byte():
    waker = Waker()
    try:
        for _ in range(100):
            waker.wake()
        assert os.read(waker.fileno(), 4096) == b"\0"
    finally:
        waker.close()


def test_a_wake_up_during_the_drain_is_not_lost(monkeypatch):
    # Another thread wakes while the I/O thread drains: whatever the interleaving, the next
    # wake-up after the drain must make the pipe readable again (else the I/O thread would
    # sleep on queued work). The drain must clear its mark only after it read the pipe empty.
    waker = Waker()
    real_read = os.read
    calls = []

    def read_with_a_wake_up_first(fd, n):
        if not calls:
            calls.append(fd)
            waker.wake()  # lands between the drain's start and its reads
        return real_read(fd, n)

    try:
        waker.wake()
        monkeypatch.setattr(workers.os, "read", read_with_a_wake_up_first)
        waker.drain()
        monkeypatch.setattr(workers.os, "read", real_read)
        assert calls and not _readable(waker)
        waker.wake()
        assert _readable(waker), "a wake-up after the drain wrote nothing: it would be lost"
        waker.drain()
        assert not _readable(waker)
    finally:
        waker.close()
