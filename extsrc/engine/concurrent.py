"""Samples in flight together inside one worker: an event loop or a few threads.

A callback that waits (on an object store, an HTTP server, a network file
system) leaves a worker idle while it waits. With ``concurrency=N`` a worker
keeps up to ``N`` samples of a task in flight:

* :class:`AsyncEngine` awaits an ``async def`` callback on the worker's
  event loop (one per worker process, made on first use, after the fork);
* :class:`ThreadEngine` calls a plain callback on ``N`` daemon threads of
  the worker (started on first use, after the fork; daemon so that a
  request that never returns cannot keep the worker from exiting).

The engines know samples only as ``(position, argument)`` jobs. Jobs start
in position order; each finished sample is handed to ``deliver`` in the
calling thread (the worker's main thread), as soon as it is back, so shared
memory is only ever written from one thread. Whatever the timing, the
outcome is that of running the jobs one by one: the first position (not the
first in time) that raises ``StopIteration``, fails, or fails to be
delivered decides it; jobs after it are cancelled (threads: their results
dropped), jobs before it are waited for. A job in flight longer than
``limit_s`` ends the run with a :class:`Hung` naming it and where it waits.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import queue
import sys
import threading
import time
import traceback
from typing import (Any, Awaitable, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Set, Tuple,
                    TypeAlias, Union)

from extsrc.engine.threads import OwnedThread

_ENDED = object()  # an async callback raised StopIteration
Job = Tuple[int, object]  # (position, the callback's argument)
Deliver = Callable[[int, object], None]  # (position, value); raises to fail that position
AsyncCallback = Callable[[Any], Awaitable[object]]  # called with a job's argument
Call: TypeAlias = "asyncio.Task[Tuple[object, int]]"  # one call of an async callback: (value, ns it took)


def is_async(callback: object) -> bool:
    """Whether calling ``callback`` gives a coroutine (``async def``, also as ``__call__``
    or under ``functools.partial``)."""
    while hasattr(callback, "func") and hasattr(callback, "args"):  # functools.partial
        callback = callback.func
    if inspect.iscoroutinefunction(callback):
        return True
    call = getattr(type(callback), "__call__", None)
    return call is not None and inspect.iscoroutinefunction(call)


class Hung(NamedTuple):
    """A job that stayed in flight longer than the limit: where it was waiting."""

    seconds: float
    stack: str


class Event(NamedTuple):
    """What ended a run early, at ``position``: ``StopIteration``, the callback's exception
    (``in_callback``), an exception from ``deliver``, or a :class:`Hung` job."""

    position: int
    error: Union[BaseException, Hung]
    in_callback: bool


class Outcome(NamedTuple):
    """A run's result: the deciding :class:`Event` (None: every job delivered), and per
    delivered job its time in flight (ns), in the order they came back."""

    event: Optional[Event]
    in_flight_ns: Tuple[int, ...]


class _Run:
    """Bookkeeping shared by both engines for one run."""

    def __init__(self, deliver: Deliver):
        self.deliver = deliver
        self.event: Optional[Event] = None
        self.times: List[int] = []

    def cut(self, event: Event) -> None:
        if self.event is None or event.position < self.event.position:
            self.event = event

    def wanted(self, position: int) -> bool:
        return self.event is None or position < self.event.position

    def finished(self, position: int, ok: bool, value: Any, ns: int) -> None:
        # value: what the callback returned, or (not ok) what it raised.
        if not self.wanted(position):
            return
        if not ok:
            self.cut(Event(position, value, True))
            return
        try:
            self.deliver(position, value)
        except BaseException as exc:  # a bad sample, memory: this position fails
            self.cut(Event(position, exc, False))
            return
        self.times.append(ns)

    def outcome(self) -> Outcome:
        return Outcome(self.event, tuple(self.times))


class AsyncEngine:
    """Runs an ``async def`` callback, up to ``concurrency`` calls at once, on this
    process's event loop."""

    def __init__(self, callback: AsyncCallback, concurrency: int):
        self.callback = callback
        self.concurrency = concurrency
        self._busy = 0  # calls in flight, over all the runs sharing the limit (run_shared)
        self._room: List[asyncio.Event] = []  # runs with calls left to start, waiting for room

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The worker's event loop (see :func:`worker_loop`)."""
        return worker_loop()

    def call(self, argument: object) -> object:
        """One call awaited to its end (batch mode); ``StopIteration`` raised inside the
        coroutine (which Python turns into a ``RuntimeError``) comes out as itself."""
        value, _ = self.loop.run_until_complete(self._one(argument))
        if value is _ENDED:
            raise StopIteration
        return value

    def run(self, jobs: Iterable[Job], deliver: Deliver, limit_s: Optional[float]) -> Outcome:
        return self.loop.run_until_complete(self._run(iter(jobs), deliver, limit_s, False))

    async def run_shared(self, jobs: Iterable[Job], deliver: Deliver,
                         limit_s: Optional[float]) -> Outcome:
        """:meth:`run` as a coroutine on the running loop, for runs that overlap (the tasks
        of one worker): all of them together keep ``concurrency`` calls in flight whenever
        they have calls left to start (a call that ends in one run lets another start one at
        once, not when its own next call ends), and a run started earlier gets the room a
        finished call frees first."""
        return await self._run(iter(jobs), deliver, limit_s, True)

    def _has_room(self, flying: int, shared: bool) -> bool:
        return (self._busy if shared else flying) < self.concurrency

    def _freed(self, _task: Call) -> None:
        self._busy -= 1
        waiting, self._room = self._room, []
        for wake in waiting:  # in the order they began to wait: earlier runs first
            wake.set()

    async def _one(self, argument: object) -> Tuple[object, int]:
        began = time.perf_counter_ns()
        try:
            value = await self.callback(argument)
        except RuntimeError as exc:
            if not isinstance(exc.__cause__, StopIteration):
                raise
            value = _ENDED  # the coroutine raised StopIteration: the end of the epoch
        return value, time.perf_counter_ns() - began

    async def _run(self, jobs: Iterator[Job], deliver: Deliver, limit_s: Optional[float],
                   shared: bool) -> Outcome:
        loop = asyncio.get_running_loop()
        run = _Run(deliver)
        flying: Dict[Call, Tuple[int, float]] = {}  # task -> (position, started)
        finished: List[Call] = []  # this run's calls that ended, not yet reported
        wake = asyncio.Event()  # set when one of this run's calls ends, or room frees (shared)

        def ended(task: Call) -> None:
            finished.append(task)
            wake.set()

        exhausted = False
        try:
            while True:
                while not exhausted and self._has_room(len(flying), shared):
                    job = next(jobs, None)
                    if job is None or not run.wanted(job[0]):
                        exhausted = True
                        break
                    position, argument = job
                    task = loop.create_task(self._one(argument))
                    task.add_done_callback(ended)  # O(1) per sample, unlike wait()
                    if shared:
                        self._busy += 1
                        task.add_done_callback(self._freed)
                    flying[task] = (position, loop.time())
                if not flying and exhausted:
                    return run.outcome()
                if shared and not exhausted and wake not in self._room:
                    self._room.append(wake)  # a call of another run ending makes room for ours
                if not finished:
                    if limit_s is not None and flying:
                        timeout = max(0.0, min(s for _, s in flying.values()) + limit_s - loop.time())
                        try:
                            await asyncio.wait_for(wake.wait(), timeout)
                        except asyncio.TimeoutError:
                            self._cut_hung(run, flying, limit_s, loop.time())
                    else:
                        await wake.wait()
                wake.clear()
                done = [task for task in finished if task in flying]  # cancelled ones are gone
                finished.clear()
                for task in sorted(done, key=lambda t: flying[t][0]):
                    position, _ = flying.pop(task)
                    self._report(run, task, position)
                if run.event is not None:  # cut: the samples after its position are not wanted
                    for task, (position, _) in list(flying.items()):
                        if not run.wanted(position):
                            task.cancel()
                            del flying[task]
        finally:
            if wake in self._room:
                self._room.remove(wake)
            for task in flying:
                task.cancel()
            if flying:
                await asyncio.wait(flying)

    @staticmethod
    def _report(run: _Run, task: Call, position: int) -> None:
        error = asyncio.CancelledError() if task.cancelled() else task.exception()
        if error is not None:
            run.finished(position, False, error, 0)
            return
        value, ns = task.result()
        if value is _ENDED:
            run.finished(position, False, StopIteration(), ns)
        else:
            run.finished(position, True, value, ns)

    @staticmethod
    def _cut_hung(run: _Run, flying: Dict[Call, Tuple[int, float]], limit_s: float, now: float) -> None:
        for task, (position, started) in sorted(flying.items(), key=lambda r: r[1][0]):
            if now - started >= limit_s and run.wanted(position) and not task.done():
                run.cut(Event(position, Hung(now - started, _task_stack(task)), True))
                return


_loop: Optional[asyncio.AbstractEventLoop] = None
_loop_pid = 0


def worker_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop for callbacks, shared by its sources; made on first use,
    never inherited through a fork (a child makes its own)."""
    global _loop, _loop_pid
    if _loop is None or _loop_pid != os.getpid():
        asyncio.events._set_running_loop(None)  # a fork from inside a running loop leaves its mark
        _loop, _loop_pid = asyncio.new_event_loop(), os.getpid()
    return _loop


def _task_stack(task: Call) -> str:
    frames = task.get_stack()
    lines = []
    for frame in frames:
        lines.extend(traceback.format_stack(frame, limit=1))
    coro = task.get_coro()
    inner = getattr(coro, "cr_await", None)
    while inner is not None and hasattr(inner, "cr_frame") and inner.cr_frame is not None:
        lines.extend(traceback.format_stack(inner.cr_frame, limit=1))
        inner = getattr(inner, "cr_await", None)
    return "".join(dict.fromkeys(lines))  # each frame once, outermost first


class ThreadEngine:
    """Calls a plain callback on ``concurrency`` threads of this process."""

    def __init__(self, callback: Callable[[Any], object], concurrency: int):  # takes a job's argument
        self.callback = callback
        self.concurrency = concurrency
        # (run, token, argument) of each job; None tells a thread to end.
        self._jobs: "queue.SimpleQueue[Optional[Tuple[int, int, object]]]" = queue.SimpleQueue()
        # (run, token, ok, value, ns): value as in _Run.finished.
        self._results: "queue.SimpleQueue[Tuple[int, int, bool, Any, int]]" = queue.SimpleQueue()
        self._threads: List[OwnedThread] = []
        self._running: Dict[int, int] = {}  # run token -> thread ident, for a hung job's stack
        self._tokens = 0
        self._run_id = 0
        self._live_run = 0  # jobs of any other run are skipped, not called
        self._dropped: Set[int] = set()  # tokens of this run no longer wanted (after the deciding one)

    def _ensure_threads(self) -> None:
        """Started in the worker on first use; a thread lost to a hung call is replaced."""
        # Listed before it starts: an interrupt anywhere leaves each thread that exists listed
        # (``started`` is true whenever it does), and one that never started is dropped here
        # (begun() settles one whose start was interrupted: it may never have begun).
        self._threads = [t for t in self._threads if t.begun() and not t.ended]
        while len(self._threads) < self.concurrency:
            thread = OwnedThread(self._serve, f"extsrc-sample-{len(self._threads)}")
            self._threads.append(thread)
            thread.start()

    def _serve(self) -> None:
        callback, jobs, results, running = self.callback, self._jobs, self._results, self._running
        ident = threading.get_ident()
        while True:
            job = jobs.get()
            if job is None:
                return
            run_id, token, argument = job
            if run_id != self._live_run or token in self._dropped:
                continue  # the run no longer wants it: a sequential run would not have called it
            running[token] = ident
            began = time.perf_counter_ns()
            try:
                value, ok = callback(argument), True
            except BaseException as exc:
                value, ok = exc, False
            running.pop(token, None)
            results.put((run_id, token, ok, value, time.perf_counter_ns() - began))

    def run(self, jobs: Iterable[Job], deliver: Deliver, limit_s: Optional[float]) -> Outcome:
        self._ensure_threads()
        self._run_id += 1
        run_id = self._live_run = self._run_id
        self._dropped.clear()
        try:
            return self._run(run_id, jobs, deliver, limit_s)
        finally:
            self._live_run = 0

    def _run(self, run_id: int, jobs: Iterable[Job], deliver: Deliver,
             limit_s: Optional[float]) -> Outcome:
        run = _Run(deliver)
        jobs = iter(jobs)
        flying: Dict[int, Tuple[int, float]] = {}  # token -> (position, started)
        exhausted = False
        while True:
            while not exhausted and len(flying) < self.concurrency:
                job = next(jobs, None)
                if job is None or not run.wanted(job[0]):
                    exhausted = True
                    break
                self._tokens += 1
                flying[self._tokens] = (job[0], time.monotonic())
                self._jobs.put((run_id, self._tokens, job[1]))
            if run.event is not None:  # cut: the samples after its position are not wanted
                for token in [t for t, f in flying.items() if not run.wanted(f[0])]:
                    self._dropped.add(token)
                    del flying[token]
            if not flying:
                return run.outcome()
            timeout = None
            if limit_s is not None:
                timeout = max(0.0, min(s for _, s in flying.values()) + limit_s - time.monotonic())
            try:
                got_run, token, ok, value, ns = self._results.get(timeout=timeout)
            except queue.Empty:
                token, (position, started) = min(flying.items(), key=lambda r: r[1][1])
                ident = self._running.get(token)
                frame = sys._current_frames().get(ident) if ident is not None else None
                stack = "".join(traceback.format_stack(frame)) if frame is not None else "(not started)\n"
                run.cut(Event(position, Hung(time.monotonic() - started, stack), True))
                continue
            if got_run != run_id or token not in flying:
                continue  # a job of an earlier run, or one dropped after the outcome was cut
            position, _ = flying.pop(token)
            run.finished(position, ok, value, ns)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
