"""The worker process: load the sources, then serve the pool's messages until told to stop.

A worker owns its channel to the pool, the descriptors of the slots it was
sent (:class:`~extsrc.engine.protocol.AddSlot`) and nothing else: a fork
worker first unmaps and closes what it inherited from the parent.

It exits when the pool sends :class:`~extsrc.engine.protocol.Stop`, when its
channel closes (the pool closed, or the parent died), or when the pool's
process dies while a callback runs: the kernel kills it, even if the
callback holds the GIL in a long C call, by two means that need no thread
of the worker. ``PR_SET_PDEATHSIG`` ties it to the thread that started it,
which is the right one only with ``fork``/``spawn`` from the main thread;
the *lifeline* ties it to the pool's process whatever started it (a fork
server, another thread): a pipe whose write end only the pool's process
holds, and whose read end the worker owns with ``O_ASYNC`` and
``F_SETSIG=SIGKILL``, so that the kernel sends the worker ``SIGKILL`` when
the last write end closes (see :class:`extsrc.engine.workers.Lifeline`).
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import gc
import os
import resource
import select
import signal
import traceback
from typing import Callable, Dict, List, Mapping, Optional, Set, Tuple

from extsrc import forking
from extsrc.engine.channel import Channel, DupFd
from extsrc.engine.concurrent import AsyncEngine, worker_loop
from extsrc.engine.protocol import AddSlot, DropSlot, Message, Result, SetupFailed, Stop, Task, WorkerSetup
from extsrc.engine.runner import SourceRunner, load_source
from extsrc.engine.worker_malloc import keep_freed_memory

_PR_SET_PDEATHSIG = 1
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)  # Linux: the signal sent when the descriptor is ready


class LifelineEnd:
    """The worker's end of its lifeline (see the module docstring): a descriptor that
    travels to the worker with its ``Process`` (inherited by ``fork``, passed by
    ``spawn``/``forkserver``)."""

    def __init__(self, fd: int):
        self.fd = fd

    def arm(self) -> None:
        """In the worker: from now on the kernel kills this process once the pool's
        process is gone; exits at once if it is gone already."""
        fcntl.fcntl(self.fd, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(self.fd, _F_SETSIG, signal.SIGKILL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_ASYNC)
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        if poller.poll(0):  # the write end closed before the signal was armed
            os._exit(0)

    def __reduce__(self) -> Tuple[Callable[[DupFd], LifelineEnd], Tuple[DupFd]]:
        # Only for handing the end to a spawn/forkserver worker in Process.start().
        from multiprocessing import reduction

        return (_rebuild_lifeline_end, (reduction.DupFd(self.fd),))


def _rebuild_lifeline_end(dup: DupFd) -> LifelineEnd:
    return LifelineEnd(dup.detach())


def _die_with_parent(parent_pid: Optional[int], reliable: bool, lifeline: LifelineEnd) -> None:
    if parent_pid is None:
        parent_pid = os.getppid()
    if reliable:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(0)
    lifeline.arm()


def _raise_descriptor_limit() -> None:
    """Lets the worker open as many descriptors as it may: each slot of each source costs
    it two, and a worker that cannot receive them could not go on. The pool's process keeps
    the limit its user chose."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError):
            pass


def worker_main(setup: WorkerSetup, channel: Channel, lifeline: LifelineEnd) -> None:
    """Entry point of a worker process (the ``target`` of its ``Process``)."""
    if setup.forked:
        # Forked with the collector off (extsrc.forking.start_forking): what the worker
        # inherited is never collected here, so no finalizer of the parent's objects runs in
        # it (a DALI pipeline's waits for threads the worker does not have, for good).
        gc.freeze()
        gc.enable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with_parent(setup.parent_pid, setup.die_with_parent, lifeline)
    _raise_descriptor_limit()
    if setup.forked:
        forking.drop_inherited_memory()
    keep_freed_memory()
    runners: Dict[int, SourceRunner] = {}
    try:
        for source in setup.sources:
            callback, hooks = load_source(source, setup.pickler)
            runners[source.source_id] = SourceRunner(source, callback, setup.index, hooks)
    except BaseException as exc:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            channel.send(SetupFailed(setup.index, f"{type(exc).__name__}: {exc}", text))
        except OSError:
            pass
        return
    if any(runner.overlaps for runner in runners.values()) and not any(
            isinstance(runner.engine, AsyncEngine) and not runner.overlaps
            for runner in runners.values()):  # an async batch-mode callback runs the loop itself
        _serve_overlapping(channel, runners, setup.index)
        return
    serve(channel, runners, setup.index)


def serve(channel: Channel, runners: Mapping[int, SourceRunner], index: int) -> None:
    """The worker's loop, in the thread that calls it: each task is run where it arrives and
    answered when done; slots are added (with the descriptors that came with them) and
    dropped in the order sent. Returns when the pool says :class:`Stop` or the channel closes
    (also a Ray actor on the consumer's node serves its pool with it, ``index`` its worker)."""
    while True:
        try:
            message, fds = channel.recv()
        except (EOFError, OSError):
            return
        if isinstance(message, Task):
            result = runners[message.source_id].run(message)
            try:
                channel.send(result)
            except OSError:
                return
        elif isinstance(message, AddSlot):
            runners[message.source_id].writer.add_slot(message.slot_id, fds[0], fds[1],
                                                       message.kind, index)
        elif isinstance(message, DropSlot):
            runners[message.source_id].writer.drop_slot(message.slot_id)
        elif isinstance(message, Stop):
            return


def _serve_overlapping(channel: Channel, runners: Dict[int, SourceRunner], index: int) -> None:
    """The worker's loop when its sources' samples share the event loop (``async def`` callbacks
    in sample mode): each task runs as a coroutine from the moment it arrives, so that the
    samples of the next task start while the current one's are in flight, and its result is
    sent as soon as its own samples are back (tasks of one batch, or of the next, may finish
    in any order: the pool matches results by ticket). Other sources' tasks run to their end
    where they arrive. Messages are read in the order sent, so a slot is added before a task
    writes into it."""
    loop = worker_loop()
    ended = loop.create_future()
    running: Set["asyncio.Task[None]"] = set()

    def end() -> None:
        if not ended.done():
            ended.set_result(None)

    def send(result: Result) -> None:
        try:
            channel.send(result)
        except OSError:
            end()

    failures: List[BaseException] = []  # raised in a callback of the loop: ends the worker

    async def run(runner: SourceRunner, task: Task) -> None:
        try:
            send(await runner.run_overlapping(task))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            failures.append(exc)
            end()

    def readable() -> None:
        while True:  # every message the read brought: the loop is told of the socket only
            try:
                message, fds = channel.recv()
            except (EOFError, OSError):
                end()
                return
            try:
                handle(message, fds)
            except BaseException as exc:
                failures.append(exc)
                end()
                return
            if ended.done() or not channel.buffered():
                return

    def handle(message: Message, fds: List[int]) -> None:
        if isinstance(message, Task):
            runner = runners[message.source_id]
            if runner.overlaps:
                job = loop.create_task(run(runner, message))
                running.add(job)
                job.add_done_callback(running.discard)
            else:
                send(runner.run(message))
        elif isinstance(message, AddSlot):
            runners[message.source_id].writer.add_slot(message.slot_id, fds[0], fds[1],
                                                       message.kind, index)
        elif isinstance(message, DropSlot):
            runners[message.source_id].writer.drop_slot(message.slot_id)
        elif isinstance(message, Stop):
            end()

    loop.add_reader(channel.fileno(), readable)
    try:
        loop.run_until_complete(ended)
    finally:
        loop.remove_reader(channel.fileno())
        left = list(running)
        for job in left:
            job.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left))
    if failures:
        raise failures[0]
