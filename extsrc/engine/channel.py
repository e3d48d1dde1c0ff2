"""A message channel between the pool and one worker: a Unix socket pair, framed, with fd passing.

Each frame is a header (payload length, number of descriptors) and a
pickled message; descriptors ride on the header as ``SCM_RIGHTS``, so they
arrive with the message they belong to (an :class:`~extsrc.engine.protocol.AddSlot`
carries the segments of a new slot). The pool's end is used only by the
pool's I/O thread; the worker's end only by the worker's main thread.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import time
from typing import Any, List, Sequence, Tuple

from extsrc import forking

_HEADER = struct.Struct("<IB")  # payload bytes, descriptors attached
MAX_FDS = 8  # per message; AddSlot sends 2
_READ_CHUNK = 1 << 16  # bytes the pool end reads at a time (many results fit in one read)

# The pool's end never blocks longer than this on one frame: a worker writes
# each frame in one go, and a peer stuck for this long is broken anyway.
POOL_END_TIMEOUT_S = 30.0


class Channel:
    """One end of a pool-worker connection; see the module docstring."""

    def __init__(self, sock: socket.socket, pool_end: bool):
        self.sock = sock
        self._pid = os.getpid()
        self._pool_end = pool_end
        # Pool end: bytes received [0, _filled) and not yet parsed into messages. Received into
        # in place: a recv() of _READ_CHUNK made a 64 KiB bytes object per call, and each such
        # allocation made glibc consolidate its free lists (~4,000 times a second).
        self._inbox = bytearray(_READ_CHUNK if pool_end else 0)
        self._filled = 0
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

    def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        """Sends ``message`` (and ``fds``, duplicated into the peer). Raises ``OSError`` if
        the peer is gone."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = memoryview(_HEADER.pack(len(payload), len(fds)) + payload)
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

    def recv(self) -> Tuple[Any, List[int]]:
        """The next message and the descriptors that came with it (now owned by the caller).

        Raises ``EOFError`` when the peer closed its end.
        """
        header, fds, _flags, _addr = socket.recv_fds(
            self.sock, _HEADER.size, MAX_FDS, socket.MSG_CMSG_CLOEXEC
        )
        if not header:
            raise EOFError("the channel was closed by its peer")
        header += self._recv_exactly(_HEADER.size - len(header))
        length, count = _HEADER.unpack(header)
        if count != len(fds):
            for fd in fds:
                os.close(fd)
            raise OSError(f"expected {count} descriptors with the message, got {len(fds)}")
        try:
            return pickle.loads(self._recv_exactly(length)), list(fds)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def recv_available(self) -> List[Any]:
        """Pool end: every message that has arrived whole, without waiting (may be none).

        Workers never send descriptors, so this reads plain bytes, as many as
        are there, and keeps a partial message for the next call. Raises
        ``EOFError`` when the worker closed its end.
        """
        inbox = self._inbox
        while True:
            if self._filled == len(inbox):
                inbox.extend(bytes(len(inbox)))  # a message longer than the buffer: twice as long
            with memoryview(inbox) as view:
                try:
                    got = self.sock.recv_into(view[self._filled:])
                except BlockingIOError:
                    break
            if not got:
                if self._filled:
                    raise EOFError("the channel was closed in the middle of a message")
                raise EOFError("the channel was closed by its peer")
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
                messages.append(pickle.loads(view[offset + _HEADER.size:end]))
                offset = end
            if offset:
                view[:filled - offset] = view[offset:filled]  # a partial message to the front
        self._filled = filled - offset
        if not self._filled and len(inbox) > _READ_CHUNK:
            del inbox[_READ_CHUNK:]  # back to its size after a long message
        return messages

    def _recv_exactly(self, size: int) -> bytes:
        if size == 0:
            return b""
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        while got < size:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise EOFError("the channel was closed in the middle of a message")
            got += n
        return bytes(buffer)

    def close(self) -> None:
        if not self._pool_end or self._pid == os.getpid():
            self.sock.close()

    def forget_after_fork(self) -> None:
        # A child holding a worker's socket would keep that worker from seeing its parent die.
        try:
            os.close(self.sock.detach())
        except OSError:
            pass

    def __reduce__(self):
        # Only for handing the worker's end to a spawn/forkserver worker in Process.start().
        from multiprocessing import reduction

        return (_rebuild_worker_end, (reduction.DupFd(self.sock.fileno()),))


class OwnedFds:
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

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _rebuild_worker_end(dup) -> Channel:
    return Channel(socket.socket(fileno=dup.detach()), pool_end=False)
