"""Worker processes as the pool sees them: starting, stopping, and why one ended.

A :class:`WorkerHandle` is owned by one pool. Worker processes are
``multiprocessing`` processes (so that ``spawn`` and ``forkserver`` prepare
the main module as users expect), but the pool reaps them itself: they are
taken off ``multiprocessing``'s list of children right after start, so that
``multiprocessing``'s exit handler never terminates them from a forked child
of the consumer that happens to exit (see :mod:`extsrc.forking`).
"""

from __future__ import annotations

import _socket
import _thread
import contextlib
import multiprocessing

# Joining a process with a timeout imports multiprocessing.connection (and maps its C module):
# imported here, stop() never needs memory for that, which under ulimit -v may be gone then.
import multiprocessing.connection  # noqa: F401
import multiprocessing.process
import os
import signal
import sys
import threading
import time
import types
from collections import deque
from multiprocessing.process import BaseProcess
from typing import Callable, Deque, Dict, Iterator, List, Optional, Protocol, Sequence, Set, Tuple, cast

from extsrc import forking
from extsrc.engine.channel import Channel, OwnedFds
from extsrc.engine.protocol import Stop, Task, ToWorker, WorkerSetup
from extsrc.engine.threads import OwnedThread
from extsrc.engine.worker import LifelineEnd, worker_main
from extsrc.closing import ClosedWhenCollected

# A worker asked to stop finishes its current callback first; most are done in
# milliseconds, and one second covers a loaded machine. After that: SIGTERM,
# then SIGKILL, each with the same grace.
STOP_GRACE_S = 1.0
# Reading the exit status of a worker whose socket or sentinel says it ended.
EXIT_STATUS_WAIT_S = 1.0
# Descriptors the pool's process holds per running worker: its channel, its lifeline, its
# sentinel; and at most this many more while one starts (socket pair, the lifeline's read end,
# multiprocessing's pipes and its connection to a fork server). A fork server whose client runs
# out of descriptors half way through a request exits, taking every worker it started along.
DESCRIPTORS_PER_WORKER = 3
DESCRIPTORS_TO_START_ONE = 10
# While forkserver workers start, an interrupt is held until they all started (see
# launch_on_a_thread); a start takes milliseconds, a second or so on a loaded machine or with
# a fork server still starting. One landing later than this is raised at once, so that Ctrl-C
# still ends the wait for a fork server that stopped answering.
INTERRUPT_HOLD_S = 10.0


class MakesProcesses(Protocol):
    """A ``multiprocessing`` context (``context.Process`` starts its kind of process)."""

    def Process(self, *, target: Callable[[WorkerSetup, Channel, LifelineEnd], None],
                args: Tuple[WorkerSetup, Channel, LifelineEnd], name: str, daemon: bool) -> BaseProcess: ...


class Lifeline(ClosedWhenCollected):
    """The pool's end of a worker's lifeline (see :mod:`extsrc.engine.worker`).

    Only the pool's process holds the write end (a forked child closes its
    copy at once, see :mod:`extsrc.forking`); the kernel kills the worker
    when it closes, so it is closed only once the worker has been reaped,
    or when the process dies.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        with forking.lock:
            self.read_fd, self._write_fd = os.pipe2(os.O_CLOEXEC)
            forking.register(self)

    def close_read_end(self) -> None:
        """Once the worker has its own copy of the read end (after ``Process.start()``)."""
        fd, self.read_fd = self.read_fd, -1
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        """Closes both ends (idempotent); a worker still alive is killed by the kernel."""
        self.close_read_end()
        self.close_write_end()

    def close_write_end(self) -> None:
        """Closes the pool's end (idempotent): a worker still alive is killed by the kernel."""
        fd, self._write_fd = self._write_fd, -1
        if fd >= 0 and self._pid == os.getpid():
            os.close(fd)

    def forget_after_fork(self) -> None:
        # The write end only: a fork worker being started needs its read end.
        fd, self._write_fd = self._write_fd, -1
        if fd >= 0:
            forking.close_inherited((fd,))


class WorkerHandle:
    """One worker process: its channel, the tasks it holds, the messages waiting for it."""

    def __init__(self, index: int, process: BaseProcess, channel: Channel, lifeline: Lifeline):
        pid = process.pid
        assert pid is not None, "a process that started has a pid"
        self.index = index
        self.process = process
        self.pid = pid
        self.channel = channel
        self.lifeline = lifeline
        self.outstanding: Dict[int, Task] = {}  # ticket -> task, in the order sent
        self.busy_since = time.monotonic()
        self.outbox: Deque[Tuple[ToWorker, Optional[OwnedFds]]] = deque()  # (message, fds to send)

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def discard_outbox(self) -> None:
        while self.outbox:
            _message, fds = self.outbox.popleft()
            if fds is not None:
                fds.close()


def launch(context: MakesProcesses, setup: WorkerSetup, run_main: bool
           ) -> Tuple[WorkerHandle, Optional[KeyboardInterrupt]]:
    """Starts one worker process with ``setup``, in the calling thread (a forkserver worker in
    the thread of :func:`launch_on_a_thread`). Returns it, and an interrupt that landed in a
    fork hook of another library, for the caller to raise once the worker is recorded (see
    :func:`extsrc.forking.start_forking`).

    ``run_main=False`` (spawn/forkserver): the worker does not import the
    main script again, as ``multiprocessing`` would (see :func:`_main_hidden`).
    """
    held: Optional[KeyboardInterrupt] = None
    pool_end, worker_end = Channel.pair()
    lifeline = Lifeline()
    try:
        process = context.Process(
            target=worker_main,
            args=(setup, worker_end, LifelineEnd(lifeline.read_fd)),
            name=f"extsrc-worker-{setup.index}",
            daemon=True,
        )
        try:
            with _main_hidden(not run_main):
                if setup.forked:
                    held = forking.start_forking(process.start)
                else:
                    process.start()
        finally:  # the worker has its copies of its ends, or never will
            worker_end.close()
            lifeline.close_read_end()
    except BaseException:
        pool_end.close()
        lifeline.close_write_end()  # a worker started all the same dies with it
        raise
    # The pool reaps its workers itself (see the module docstring).
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]  # private: not in the stubs
    return WorkerHandle(setup.index, process, pool_end, lifeline), held


def launch_on_a_thread(context: MakesProcesses, setups: Sequence[WorkerSetup], run_main: bool,
                       workers: List[WorkerHandle]) -> Optional[KeyboardInterrupt]:
    """Starts a forkserver worker for each of ``setups`` (:func:`launch`) on a thread of its own,
    adds them to ``workers`` and returns an interrupt that landed meanwhile, for the pool to
    raise once its start is committed. Caller: the thread starting the pool; ``workers`` is the
    caller's, changed in that thread only.

    A start is a request to multiprocessing's fork server, which exits when a request stops
    half way (a ``KeyboardInterrupt`` in the requesting thread, between sending descriptors
    and the process data): the next start is refused, and every worker the server started, for
    any source, looks ended. On a thread of its own no interrupt splits one (interrupts are
    raised in the main thread only), and the caller only waits. An interrupt in that wait is
    held, not raised: a pool start takes tens of milliseconds with forkserver, and raised at
    once, an interrupt made the pool undo its start, with workers that had to be stopped again
    half started; under a storm of interrupts no start finished then, and the workers undone
    kept the machine busy. One landing after :data:`INTERRUPT_HOLD_S`, or between the lines
    here, is raised at once: the workers the thread started are then stopped (by the thread if
    it still runs, else by the caller, to whom they were added). A failed start is raised with
    the workers started before it added.
    """
    made: List[WorkerHandle] = []
    failure: List[BaseException] = []
    # Taken by whichever ends first: run() (its workers are the caller's, to add) or the caller
    # giving up while run() goes on (run() stops its workers itself). A C call no interrupt splits.
    claim = _thread.allocate_lock()

    def run() -> None:
        try:
            for setup in setups:
                made.append(launch(context, setup, run_main)[0])  # forkserver: no fork here
        except BaseException as exc:  # raised in the caller's thread
            failure.append(exc)
        if not claim.acquire(False):
            stop(made, ask=False)  # nobody waits for these any more

    thread = OwnedThread(run, "extsrc-forkserver-start")
    held: Optional[KeyboardInterrupt] = None
    try:
        began = time.monotonic()
        try:
            thread.start()
        except RuntimeError:  # no thread could be made, or it never began: see below
            pass
        while not thread.ended and thread.started:
            try:
                thread.join()
            except KeyboardInterrupt as exc:
                if time.monotonic() - began > INTERRUPT_HOLD_S:
                    raise
                held = exc
        if not thread.ended:  # run() never ran on the thread: the starts are made here, interruptible
            run()
    finally:
        if not claim.acquire(False):  # run() ended: its workers are the caller's
            workers.extend(made)
    if failure:
        raise failure[0]
    return held


@contextlib.contextmanager
def _main_hidden(hide: bool) -> Iterator[None]:
    """Hides where ``__main__`` came from while a spawn/forkserver worker starts.

    ``multiprocessing`` makes a new worker import the main script again, so
    that objects pickled by reference to ``__main__`` can be found. extsrc's
    default pickler sends everything of ``__main__`` by value, so that import
    only costs time (the script's top-level imports, in every worker) and
    breaks scripts without an ``if __name__ == "__main__":`` guard. With
    another pickler the main script is imported as usual. Starts may overlap
    (see :class:`_MainHiding`).
    """
    main = sys.modules.get("__main__")
    if not hide or main is None:
        yield
        return
    token = object()
    try:  # entered inside: an interrupt anywhere in enter() still leaves
        _hiding.enter(main, token)
        yield
    finally:
        # One C call first: an interrupt at the start of leave() cannot keep the token.
        _hiding.starts.discard(token)
        _hiding.leave()


class _MainHiding:
    """``__main__``'s ``__file__`` and ``__spec__``, hidden while any start is in
    :func:`_main_hidden`: the first start to enter hides them, the last to leave
    restores them.

    Starts overlap: a forkserver start goes on on its thread after an interrupt
    made its launch give up, beside the next launch's; two consumer threads start
    sources. Each start saving and restoring on its own let one that ended
    restore the script's path while another was still starting: that worker
    imported the main script (and ran a script without a ``__main__`` guard), and
    the last to end restored the hidden values. Any thread; the starts and the
    values change under a C lock taken in ``with`` statements only. An interrupt
    may cut ``enter`` or ``leave`` anywhere: each start is known by a token, added
    first in ``enter`` and discarded by one C call before ``leave``; the values
    are saved before anything is hidden, and restored before the mark that they
    are hidden is cleared, so a cut leave is finished by the next start's. In a
    forked child the starting threads are gone: :meth:`forget_after_fork`
    restores.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.starts: Set[object] = set()  # tokens of the starts in _main_hidden(True) now
        self._saved: Dict[str, object] = {}  # what __main__ had before the first of them
        self._main: Optional[types.ModuleType] = None  # set while the values are hidden
        forking.register(self)

    def enter(self, main: types.ModuleType, token: object) -> None:
        with self._lock:
            self.starts.add(token)
            if self._main is None:
                self._saved = {name: main.__dict__[name] for name in ("__file__", "__spec__")
                               if name in main.__dict__}
                self._main = main
                main.__dict__.pop("__file__", None)
                main.__dict__["__spec__"] = None

    def leave(self) -> None:
        """After a start discarded its token: restores the values if no start is left."""
        with self._lock:
            if not self.starts:
                self._restore()

    def _restore(self) -> None:
        main = self._main
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(self._saved)
            self._main = None

    def forget_after_fork(self) -> None:
        # The lock may have been held by a thread that is not in the child: a fresh one.
        self._lock = threading.Lock()
        self.starts = set()
        self._restore()


_hiding = _MainHiding()


def stop(workers: Sequence[WorkerHandle], ask: bool) -> None:
    """Stops ``workers``: asks them (``Stop``) if ``ask``, then SIGTERM, then SIGKILL; reaps them."""
    for worker in workers:
        worker.discard_outbox()
        if ask:
            try:
                worker.channel.send(Stop())
            except OSError:
                pass
        worker.channel.close()
    deadline = time.monotonic() + (STOP_GRACE_S if ask else 0.0)
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [w.process for w in workers if w.process.exitcode is None]
        if not alive:
            break
        for process in alive:
            pid = process.pid
            assert pid is not None, "a process that started has a pid"
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        for process in alive:
            process.join(STOP_GRACE_S)
    for worker in workers:
        if worker.process.exitcode is not None:
            worker.process.close()
        worker.lifeline.close()


def describe_exit(worker: WorkerHandle, start_method: Optional[str]) -> Tuple[str, str]:
    """``(how it ended, hint)`` for a worker that ended without being asked to."""
    process = worker.process
    process.join(EXIT_STATUS_WAIT_S)
    code = process.exitcode
    hint = ""
    if code is None:
        how = "closed its connection"
    elif code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = f"was killed by {name} (signal {-code})"
        if -code == signal.SIGKILL:
            hint = " SIGKILL often comes from the kernel's out-of-memory killer (see dmesg)."
        elif -code == signal.SIGBUS:
            hint = " SIGBUS usually means shared memory ran out."
        elif -code == signal.SIGSEGV:
            hint = (" SIGSEGV is a crash in native code (the callback, a library it uses), or "
                    "a callback reading a batch of another source that it captured.")
    else:
        how = f"exited with code {code}"
        if code == 1 and start_method != "fork":
            how += (
                " (with spawn/forkserver a worker fails like this when the main script "
                "starts workers without an `if __name__ == '__main__':` guard, or cannot "
                "import something; its stderr above says which)"
            )
    return how, hint


class Waker(ClosedWhenCollected):
    """Wakes the pool's I/O thread; safe from any thread, at any time.

    A small C-level lock (taken in ``with`` statements only, so no
    ``KeyboardInterrupt`` can leave it held) makes :meth:`close` and
    :meth:`wake` exclusive: once closed, a late wake-up does nothing, and
    never writes into a descriptor number the process has since reused. A
    full pipe is ignored (a wake-up is pending already).

    A wake-up that is still pending writes nothing (a pipe write costs more
    than the rest of a take): :meth:`wake` writes only when no byte is
    pending, and :meth:`drain` clears that mark only after it has read the
    pipe empty. Contract: the caller queues its work before :meth:`wake`, and
    the reader looks at the work after :meth:`drain`; a wake-up skipped while
    the drain runs is then covered by that look. (Clearing the mark before
    reading would lose wake-ups: a byte written in between would be read with
    the mark left set, and no later wake-up would write again.)

    The "pipe" is a pair of connected sockets: made by one C call that returns
    them as objects owning their descriptors, so an interrupt right after it,
    or between the two closes of :meth:`close`, leaves nothing open once the
    objects go (``os.pipe2`` returns bare numbers, lost to such an interrupt).
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._open = True
        self._pending = False  # a byte is in the pipe, or a drain has not finished
        self._lock = threading.Lock()
        with forking.lock:
            ends = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
            for end in ends:
                end.setblocking(False)
            self._ends = ends
            self._read, self._write = ends[0].fileno(), ends[1].fileno()
            forking.register(self)

    def fileno(self) -> int:
        return self._read

    def wake(self, _write: Callable[[int, bytes], int] = os.write) -> None:
        # _write bound here: a wake-up may come at interpreter exit, once module names are None.
        if self._pending:
            return  # read after the caller's work was queued: the drain's reader sees it
        with self._lock:
            if self._open and not self._pending:
                self._pending = True
                try:
                    _write(self._write, b"\0")
                except OSError:
                    pass  # full: a wake-up is pending already

    def drain(self) -> None:
        """Reads every pending wake-up; the caller looks at the queued work afterwards."""
        try:
            while os.read(self._read, 4096):
                pass
        except OSError:
            pass
        self._pending = False  # only now: see the class docstring

    def close(self) -> None:
        """Closes the pipe (idempotent). Only once nothing polls :meth:`fileno` any more."""
        with self._lock:
            if self._pid == os.getpid():
                self._open = False
                for end in self._ends:  # each close() is idempotent: a cut close is finished
                    end.close()

    def forget_after_fork(self) -> None:
        # The lock may have been held by a thread that is not in the child: a fresh one.
        self._lock = threading.Lock()
        self._open = False
        for end in self._ends:
            end.close()


def context_for(start_method: Optional[str]) -> MakesProcesses:
    """The context of ``start_method`` (``None``: the platform's default)."""
    # The stubs type a context of a method given by name as BaseContext, which has no Process:
    # every context there is has one.
    return cast(MakesProcesses, multiprocessing.get_context(start_method))


def alive(workers: List[WorkerHandle]) -> List[WorkerHandle]:
    return [w for w in workers if w.process.exitcode is None]
