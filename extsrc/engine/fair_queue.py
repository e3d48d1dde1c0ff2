"""The pool's queue of tasks not yet sent to a worker: one line per source, served in turn.

One first-in first-out line for every source of a shared pool would let a
source whose tasks turned long (or that went far ahead) keep every other
source's tasks waiting behind its own: a microsecond task of one source
behind seconds of another's, its ``timeout=`` firing. Here each source has
its own line, in order, and the pool takes from the sources in turn, so
that a task waits for at most one task of each other source per worker
place. The pool's I/O thread and sources use it with the pool's lock held.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, Iterable, List, Optional

from extsrc.engine.protocol import Task


class FairQueue:
    """Tasks by source, each source's in the order queued; :meth:`take` serves the sources in
    turn. Lock held (the pool's)."""

    def __init__(self) -> None:
        self._lines: Dict[int, Deque[Task]] = {}
        self._turn: Deque[int] = deque()  # the sources with tasks, the next to serve first

    def __bool__(self) -> bool:
        return bool(self._turn)

    def __len__(self) -> int:
        return sum(len(line) for line in self._lines.values())

    def append(self, task: Task) -> None:
        """Queues ``task`` after its source's others."""
        line = self._lines.get(task.source_id)
        if line is None:
            line = self._lines[task.source_id] = deque()
            self._turn.append(task.source_id)
        line.append(task)

    def put_back(self, tasks: Iterable[Task]) -> None:
        """Queues ``tasks`` (in their order) before their sources' others, their sources served
        first: the tasks of a lost worker, redone before anything that came after them."""
        by_source: Dict[int, List[Task]] = {}
        for task in tasks:
            by_source.setdefault(task.source_id, []).append(task)
        for source_id, mine in reversed(list(by_source.items())):
            line = self._lines.get(source_id)
            if line is None:
                line = self._lines[source_id] = deque()
            else:
                self._turn.remove(source_id)
            line.extendleft(reversed(mine))
            self._turn.appendleft(source_id)

    def take(self, allowed: Callable[[Task], bool]) -> Optional[Task]:
        """The first task, in the sources' turn, that ``allowed`` accepts (None: none), taken
        off its line; its source's turn comes again after every other source's."""
        for position, source_id in enumerate(self._turn):
            line = self._lines[source_id]
            if not allowed(line[0]):
                continue
            task = line.popleft()
            del self._turn[position]
            if line:
                self._turn.append(source_id)
            else:
                del self._lines[source_id]
            return task
        return None

    def remove_source(self, source_id: int) -> List[Task]:
        """Takes every queued task of ``source_id`` off the queue; returns them in order."""
        line = self._lines.pop(source_id, None)
        if line is None:
            return []
        self._turn.remove(source_id)
        return list(line)
