"""A worker's answers on their way to the pool: sent at once, or held back for one short task.

Each answer a worker sends wakes the pool's I/O thread, and through it the
consumer. With small batches those wake-ups are a good part of what the
consumer's process spends per batch (1 KiB samples, batch 256, 2 workers on
2 cores: about 4,000 a second). So a worker that finishes a short task while
two more tasks already wait for it keeps the answer, runs the next task, and
sends both answers in one write: half the writes, half the wake-ups
(measured there: the I/O thread's CPU per batch 43 -> 35 us, samples/s about
+5%). The pool gives a worker processes up to three tasks for this
(:data:`extsrc.engine.processes.MAX_OUTSTANDING`); with fewer waiting, or
after a long task, every answer goes at once, as before.

A held answer waits at most about ``2 * HOLD_MAX_S``: a helper thread sends it
if the task after it takes longer (a slow or hung sample), so a finished
batch never waits behind one that does not finish. Only a callback that
holds the GIL in C code for longer than that keeps the helper from running
until it lets go.

States of the held place::

    EMPTY ──hold()──► HOLDING ──the next answer, flush(), or the helper──► EMPTY

Threads: the worker's loop (its main thread) calls every method; the helper
thread only sends a held answer. Both send with :attr:`ResultSender.lock`
held, so answers leave in the order they were made.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from extsrc.engine.channel import Channel

# The longest an answer is held back, as far as the helper thread can tell (it looks this
# often): a few scheduler time slices, far below any timeout a user sets, and long enough
# for tasks that are worth holding (a 1 KiB x 256 task takes ~0.3 ms here).
HOLD_MAX_S = 0.005
# Only answers of tasks shorter than this are held: for longer ones the write and wake-up
# per task cost nothing that matters, and the helper would send them anyway.
SHORT_TASK_S = HOLD_MAX_S
# The helper thread parks after this long without a held answer (no wake-ups of an idle or
# long-task worker); the next hold wakes it.
HELPER_IDLE_S = 0.5


class ResultSender:
    """Sends a worker's answers (see the module docstring). Made by the worker's loop, once;
    ``hold_max_s`` is :data:`HOLD_MAX_S` but in tests."""

    def __init__(self, channel: Channel, hold_max_s: float = HOLD_MAX_S):
        self.channel = channel
        self.hold_max_s = hold_max_s
        self.lock = threading.Lock()
        self._held: Optional[Any] = None  # guarded by lock
        self._held_at = 0.0
        self._last_hold = 0.0
        self._helper: Optional[threading.Thread] = None
        self._helper_failed = False
        self._busy = threading.Event()  # set while the helper should look; set and cleared under lock
        self._closed = False

    @property
    def holding(self) -> bool:
        return self._held is not None

    def deliver(self, answer: Any, task_s: float) -> None:
        """Sends ``answer``, the result of a task that took ``task_s`` seconds, together with
        one held before; or holds it if the task was short and two more tasks wait. Raises
        ``OSError`` if the pool is gone."""
        if (self._held is None and task_s < SHORT_TASK_S and not self._helper_failed
                and self.channel.waiting() >= 2):
            if self._hold(answer):
                return
        with self.lock:
            held, self._held = self._held, None
            if held is None:
                self.channel.send(answer)
            else:
                self.channel.send_many((held, answer))

    def flush(self) -> None:
        """Sends the held answer, if any (before the loop waits for a message, or ends).
        Raises ``OSError`` if the pool is gone."""
        if self._held is None:
            return
        with self.lock:
            held, self._held = self._held, None
            if held is not None:
                self.channel.send(held)

    def close(self) -> None:
        """Stops the helper thread (it is a daemon: a worker that exits does not wait for it)."""
        with self.lock:
            self._closed = True
            self._busy.set()

    def _hold(self, answer: Any) -> bool:
        if self._helper is None:
            helper = threading.Thread(target=self._look, name="extsrc-answers", daemon=True)
            try:
                helper.start()
            except (RuntimeError, MemoryError):  # no thread (e.g. ulimit -v): answers go at once
                self._helper_failed = True
                return False
            self._helper = helper
        with self.lock:
            now = time.monotonic()
            self._held, self._held_at, self._last_hold = answer, now, now
            if not self._busy.is_set():
                self._busy.set()
        return True

    def _look(self) -> None:
        """The helper thread: sends an answer held for ``hold_max_s`` or longer."""
        while True:
            self._busy.wait()
            time.sleep(self.hold_max_s)
            with self.lock:
                if self._closed:
                    return
                now = time.monotonic()
                if self._held is not None and now - self._held_at >= self.hold_max_s:
                    held, self._held = self._held, None
                    try:
                        self.channel.send(held)
                    except OSError:
                        return  # the pool is gone; the loop finds out at its next send
                elif self._held is None and now - self._last_hold >= HELPER_IDLE_S:
                    self._busy.clear()
