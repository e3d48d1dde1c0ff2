"""A message channel between the pool and one worker: a Unix socket pair, framed, with fd passing.

Each frame is a header (payload length, number of descriptors) and a
pickled message; descriptors ride on the header as ``SCM_RIGHTS``, so they
arrive with the message they belong to (an :class:`~extsrc.engine.protocol.AddSlot`
carries the segments of a new slot). The pool's end is used only by the
pool's I/O thread; the worker's end only by the worker's main thread.

Each end reads all there is at once into a buffer of its own and hands
messages out one by one, and the pool writes the messages it has for a
worker in one write (:meth:`Channel.send_many`): a system call and a
wake-up per batch of messages rather than per message.
"""

from __future__ import annotations

import array
import os
import pickle
import select
import socket
import struct
import time
from collections import deque
from typing import Callable, Deque, List, Protocol, Sequence, Tuple

from extsrc import forking
from extsrc.engine.protocol import Message, from_wire, to_wire
from extsrc.closing import ClosedWhenCollected

_HEADER = struct.Struct("<IB")  # payload bytes, descriptors attached
MAX_FDS = 8  # per message; AddSlot sends 2
_READ_CHUNK = 1 << 16  # bytes the pool end reads at a time (many results fit in one read)
_ANCILLARY_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)

# The pool's end never blocks longer than this on one frame: a worker writes
# each frame in one go, and a peer stuck for this long is broken anyway.
POOL_END_TIMEOUT_S = 30.0


class DupFd(Protocol):
    """A descriptor duplicated for a spawn/forkserver child (``multiprocessing.reduction.DupFd``):
    ``detach()`` there gives the child's own."""

    def detach(self) -> int: ...


class Channel:
    """One end of a pool-worker connection; see the module docstring."""

    def __init__(self, sock: socket.socket, pool_end: bool):
        self.sock = sock
        self._pid = os.getpid()
        self._pool_end = pool_end
        # Bytes received [0, _filled) and not yet parsed into messages. Received into in place:
        # a recv() of _READ_CHUNK made a 64 KiB bytes object per call, and each such allocation
        # made glibc consolidate its free lists (~4,000 times a second). One read takes every
        # message there is: a worker reads the tasks sent together in one system call.
        self._inbox = bytearray(_READ_CHUNK)
        self._filled = 0
        # Worker end: descriptors received and not yet handed out with their message, in the
        # order sent. The kernel hands a message's descriptors to the read that takes its first
        # byte (and ends that read there), so they come no later than the message's header.
        self._fds: Deque[int] = deque()
        if pool_end:
            sock.setblocking(False)  # reads take what is there; sends wait in _wait_writable
            forking.register(self)

    @classmethod
    def pair(cls) -> Tuple["Channel", "Channel"]:
        """``(pool end, worker end)``."""
        with forking.lock:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            return cls(a, pool_end=True), cls(b, pool_end=False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Message, fds: Sequence[int] = ()) -> None:
        """Sends ``message`` (and ``fds``, duplicated into the peer). Raises ``OSError`` if
        the peer is gone."""
        self._send_frame(_frame(message, len(fds)), fds)

    def send_many(self, messages: Sequence[Message]) -> None:
        """Sends ``messages`` (none with descriptors) in one write, in order: the peer is woken
        once for all of them. Raises ``OSError`` if the peer is gone."""
        self._send_frame(b"".join([_frame(message, 0) for message in messages]), ())

    def _send_frame(self, data: bytes, fds: Sequence[int]) -> None:
        frame = memoryview(data)
        if not self._pool_end:
            if fds:
                sent = socket.send_fds(self.sock, [frame], list(fds))
                frame = frame[sent:]
            if frame:
                self.sock.sendall(frame)
            return
        deadline = time.monotonic() + POOL_END_TIMEOUT_S
        while frame:
            try:
                if fds:
                    sent = socket.send_fds(self.sock, [frame], list(fds))
                    fds = ()
                else:
                    sent = self.sock.send(frame)
                frame = frame[sent:]
            except BlockingIOError:
                self._wait_writable(deadline)

    def _wait_writable(self, deadline: float) -> None:
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLOUT)
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not poller.poll(remaining * 1000):
            raise OSError(f"the worker read nothing for {POOL_END_TIMEOUT_S:g} s; it is stuck")

    def buffered(self) -> bool:
        """Worker end: whether :meth:`recv` has a message without reading the socket (an event
        loop watching the socket is not told of messages that came with an earlier read)."""
        filled = self._filled
        if filled < _HEADER.size:
            return False
        length: int  # (struct's results are untyped)
        length, _count = _HEADER.unpack_from(self._inbox, 0)
        return _HEADER.size + length <= filled

    def recv(self) -> Tuple[Message, List[int]]:
        """Worker end: the next message and the descriptors that came with it (now owned by
        the caller); waits for it. Raises ``EOFError`` when the peer closed its end."""
        while not self.buffered():
            if not self._read():
                raise self._closed()
        with memoryview(self._inbox) as view:
            length, count = _HEADER.unpack_from(view, 0)
            end = _HEADER.size + length
            if count > len(self._fds):
                raise OSError(f"expected {count} descriptors with the message, got {len(self._fds)}")
            fds = [self._fds.popleft() for _ in range(count)]
            try:
                message = from_wire(pickle.loads(view[_HEADER.size:end]))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            finally:  # the message is consumed either way: the next one comes out whole
                view[:self._filled - end] = view[end:self._filled]
                self._filled -= end
        self._shrink()
        return message, fds

    def _read(self) -> int:
        """Worker end: waits for bytes and reads all there are into the inbox, with the
        descriptors that came with them; the bytes read (0: the peer closed its end)."""
        self._make_room()
        with memoryview(self._inbox) as view:
            got, ancillary, msg_flags, _addr = self.sock.recvmsg_into(
                [view[self._filled:]], _ANCILLARY_SPACE, socket.MSG_CMSG_CLOEXEC)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
                self._fds.extend(fds)
        if msg_flags & socket.MSG_CTRUNC:
            raise OSError(f"a message came with more than {MAX_FDS} descriptors; some were lost")
        self._filled += got
        return got

    def recv_available(self) -> List[Message]:
        """Pool end: every message that has arrived whole, without waiting (may be none).

        Workers never send descriptors, so this reads plain bytes, as many as
        are there, and keeps a partial message for the next call. Raises
        ``EOFError`` when the worker closed its end and every whole message it
        sent was handed out.
        """
        inbox = self._inbox
        closed = False
        while True:
            self._make_room()
            with memoryview(inbox) as view:
                try:
                    got = self.sock.recv_into(view[self._filled:])
                except BlockingIOError:
                    break
            if not got:
                closed = True  # the messages read before the end still count: EOF comes after
                break
            self._filled += got
            if self._filled < len(inbox):
                break  # it took all there was
        messages = []
        offset, filled = 0, self._filled
        with memoryview(inbox) as view:
            while filled - offset >= _HEADER.size:
                length, count = _HEADER.unpack_from(view, offset)
                end = offset + _HEADER.size + length
                if filled < end:
                    break
                if count:
                    raise OSError("a worker sent descriptors, which the protocol does not allow")
                messages.append(from_wire(pickle.loads(view[offset + _HEADER.size:end])))
                offset = end
            if offset:
                view[:filled - offset] = view[offset:filled]  # a partial message to the front
        self._filled = filled - offset
        self._shrink()
        if closed and not messages:
            raise self._closed()
        return messages

    def _make_room(self) -> None:
        """Doubles the inbox when it is full (a message longer than it), so a read has room."""
        if self._filled == len(self._inbox):
            self._inbox.extend(bytes(len(self._inbox)))

    def _shrink(self) -> None:
        """Back to its size after a long message, once the inbox is empty."""
        if not self._filled and len(self._inbox) > _READ_CHUNK:
            del self._inbox[_READ_CHUNK:]

    def _closed(self) -> EOFError:
        """The error for a peer that closed its end (read returned nothing)."""
        return EOFError("the channel was closed in the middle of a message" if self._filled
                        else "the channel was closed by its peer")

    def close(self) -> None:
        if not self._pool_end or self._pid == os.getpid():
            self.sock.close()
            while self._fds:  # received with a message never read
                os.close(self._fds.popleft())

    def forget_after_fork(self) -> None:
        # A child holding a worker's socket would keep that worker from seeing its parent die.
        try:
            os.close(self.sock.detach())
        except OSError:
            pass

    def __reduce__(self) -> Tuple[Callable[[DupFd], Channel], Tuple[DupFd]]:
        # Only for handing the worker's end to a spawn/forkserver worker in Process.start().
        from multiprocessing import reduction

        return (_rebuild_worker_end, (reduction.DupFd(self.sock.fileno()),))


class OwnedFds(ClosedWhenCollected):
    """Duplicates of descriptors waiting to be sent; closed once sent or dropped.

    A forked child closes its copies at once (see :mod:`extsrc.forking`): a
    pool's fork worker must not hold another source's memory by them.
    """

    __slots__ = ("fds", "_pid", "__weakref__")

    def __init__(self, fds: Sequence[int]):
        self._pid = os.getpid()
        self.fds: Tuple[int, ...] = ()
        with forking.lock:
            try:
                for fd in fds:
                    self.fds += (os.dup(fd),)
            except BaseException:
                self.close()  # the duplicates made before the one that failed
                raise
            forking.register(self)

    def close(self) -> None:
        fds, self.fds = self.fds, ()
        if self._pid == os.getpid():
            for fd in fds:
                os.close(fd)

    def forget_after_fork(self) -> None:
        fds, self.fds = self.fds, ()
        forking.close_inherited(fds)


def _frame(message: Message, fd_count: int) -> bytes:
    payload = pickle.dumps(to_wire(message), protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload), fd_count) + payload


def _rebuild_worker_end(dup: DupFd) -> Channel:
    return Channel(socket.socket(fileno=dup.detach()), pool_end=False)
