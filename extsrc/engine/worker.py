"""The worker process: load the sources, then serve the pool's messages until told to stop.

A worker owns its channel to the pool, the descriptors of the slots it was
sent (:class:`~extsrc.engine.protocol.AddSlot`) and nothing else: a fork
worker first unmaps and closes what it inherited from the parent.

It exits when the pool sends :class:`~extsrc.engine.protocol.Stop`, when its
channel closes (the pool closed, or the parent died), or when the parent
dies while a callback runs: the kernel kills it (``PR_SET_PDEATHSIG``) even
if the callback holds the GIL in a long C call; a watchdog thread covers
the one case where that signal cannot be relied on (workers started from a
thread other than the main thread, since the signal follows the starting
thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
import traceback
from typing import Dict, Optional

from extsrc import forking
from extsrc.engine.channel import Channel
from extsrc.engine.protocol import AddSlot, DropSlot, SetupFailed, Stop, Task, WorkerSetup
from extsrc.engine.runner import SourceRunner, load_source

_PR_SET_PDEATHSIG = 1
WATCHDOG_PERIOD_S = 0.5  # how often a worker checks that its parent lives, when it must


def _die_with_parent(parent_pid: Optional[int], reliable: bool) -> None:
    if parent_pid is None:
        parent_pid = os.getppid()
    if reliable:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(0)
    if not reliable:
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="extsrc-watchdog",
                         daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(WATCHDOG_PERIOD_S)
        if os.getppid() != parent_pid:
            os._exit(0)


def worker_main(setup: WorkerSetup, channel: Channel) -> None:
    """Entry point of a worker process (the ``target`` of its ``Process``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with_parent(setup.parent_pid, setup.die_with_parent)
    if setup.forked:
        forking.drop_inherited_memory()
    runners: Dict[int, SourceRunner] = {}
    try:
        for source in setup.sources:
            callback, worker_init = load_source(source, setup.pickler)
            runners[source.source_id] = SourceRunner(source, callback, setup.index, worker_init)
    except BaseException as exc:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            channel.send(SetupFailed(setup.index, f"{type(exc).__name__}: {exc}", text))
        except OSError:
            pass
        return
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
                                                       message.kind, setup.index)
        elif isinstance(message, DropSlot):
            runners[message.source_id].writer.drop_slot(message.slot_id)
        elif isinstance(message, Stop):
            return
