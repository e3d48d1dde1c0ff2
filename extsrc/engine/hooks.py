"""What a layer (or a user) changes in how the engine runs a source: :class:`Hooks`.

The engine runs a callback the same way for everyone; where a layer needs
something else (DataLoader's order of workers, DALI's ``BatchInfo``, a
datapipe's per-epoch seed), it passes a ``Hooks`` to its source instead of
the engine growing an argument for it. Each hook names who calls it, in
which process and thread:

=================  ===================================  ==========================
hook               called by                            where
=================  ===================================  ==========================
``worker_init``    each worker, before its first task   worker process / Ray actor
``begin_epoch``    the worker of an iterable source,    worker process / Ray actor
                   before each pass (``iter()``)
``batch_info``     (a switch) the worker, for each      worker process / Ray actor
                   call of a batch-mode callable
``assign``         the pool's I/O thread, per batch     the consumer's process
``dense_arrays``   (a switch) the consumer's ``next()``  the consumer's process
=================  ===================================  ==========================

The worker-side hooks travel to the workers with the callback: under
``spawn``/``forkserver`` they are pickled together with it (objects they
share stay shared), so they must be picklable by the source's pickler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from extsrc.engine.faults import OnError
from extsrc.engine.kinds import Source

# worker_init(worker_index, num_workers)
WorkerInit = Callable[[int, int], None]
# begin_epoch(source, epoch_idx): the source is the iterable itself
BeginEpoch = Callable[[Source, int], None]
# assign(iteration, num_workers) -> the index of the worker that makes the whole batch (None: any)
Assign = Callable[[int, int], Optional[int]]


@dataclass(frozen=True)
class Hooks:
    """Hooks of one source (see the module docstring for who calls each).

    * ``worker_init(worker_index, num_workers)``: run once in each worker
      before its first task, e.g. to open a per-worker handle; what it raises
      is the pool's setup failure, raised from ``next()``.
    * ``begin_epoch(source, epoch_idx)``: in batch mode, for an iterable
      source, run in its worker right before each pass starts (before
      ``iter(source)``), so the pass can use what the consumer prepared for
      that epoch.
    * ``batch_info=True``: a batch-mode callable is called with a
      :class:`~extsrc.BatchInfo` instead of the iteration number.
    * ``assign(iteration, num_workers)``: each batch is made whole by one
      worker, batch ``iteration`` of an epoch by the worker this returns
      (``lambda i, n: i % n`` is PyTorch DataLoader's order), or by the
      least loaded one when it returns None (one slow batch then holds back
      only what its worker holds). By default a batch's samples are spread
      over the workers, so it is ready sooner.
    * ``dense_arrays=True``: an output whose samples lie side by side (one
      shape and dtype) comes as one NumPy array of shape ``(batch size,
      *sample shape)``, the zero-copy view of ``Batch.as_array()`` with the
      same lifetime, without the per-sample views a ``Batch`` is made of.
    """

    worker_init: Optional[WorkerInit] = None
    begin_epoch: Optional[BeginEpoch] = None
    batch_info: bool = False
    assign: Optional[Assign] = None
    dense_arrays: bool = False

    def __post_init__(self) -> None:
        for name in ("worker_init", "begin_epoch", "assign"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"hooks.{name} must be a callable or None, got {type(value).__name__}")
        for name in ("batch_info", "dense_arrays"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"hooks.{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def in_workers(self) -> "WorkerHooks":
        """The hooks that run in the workers, to be sent there with the callback."""
        return WorkerHooks(self.worker_init, self.begin_epoch, self.batch_info)


@dataclass(frozen=True)
class WorkerHooks:
    """The worker side of :class:`Hooks`: what a worker runs around the source's callback; and
    the source's ``on_error`` when it is not ``"raise"`` (:mod:`extsrc.engine.faults`)."""

    worker_init: Optional[WorkerInit] = None
    begin_epoch: Optional[BeginEpoch] = None
    batch_info: bool = False
    on_error: Optional[OnError] = None

    @property
    def empty(self) -> bool:
        return (self.worker_init is None and self.begin_epoch is None and not self.batch_info
                and self.on_error is None)
