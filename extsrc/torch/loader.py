"""``TorchLoader``: the batches of a ``ParallelSource`` as torch tensors, on the CPU or a GPU."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Union

import torch

from extsrc.dma import CUDA_HOST_REGISTER_PORTABLE, InFlight, PageLock, page_lock
from extsrc.engine import LoopPosition, ParallelSource, gpu_visible
from extsrc.torch.tensors import batch_tensors, each_tensor, map_tensors


def parse_device(device: Any) -> Optional[torch.device]:
    """``None`` for the CPU, else a CUDA ``torch.device``; ``ValueError`` for anything else."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (TypeError, RuntimeError, ValueError) as exc:
        raise ValueError(f"device must be None, 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r} "
                         f"({exc})") from None
    if parsed.type == "cpu":
        return None
    if parsed.type != "cuda":
        raise ValueError(f"device must be the CPU or a CUDA device, got {device!r} ({parsed.type})")
    return parsed


def cuda_device(device: Optional[torch.device], what: str) -> torch.device:
    """``device`` (None: the current one) with its index, or ``RuntimeError`` without CUDA."""
    if torch.cuda.is_available():
        index = None if device is None else device.index
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)
    if torch.version.cuda is None:
        why = f"this PyTorch ({torch.__version__}) is built without CUDA"
    else:
        why = gpu_visible()[1] or "no CUDA device is usable here"
    raise RuntimeError(f"{what} needs CUDA, and torch.cuda.is_available() is False: {why}. Leave device= and "
                       "pin_memory= at their defaults to get CPU tensors, or run where a GPU is visible")


class _Handed:
    """The last CPU batch a pinned loader handed out, kept until an event covers its copies."""

    __slots__ = ("tensors", "device")

    def __init__(self) -> None:
        self.tensors: Any = None
        self.device: Optional[torch.device] = None

    def cover(self, in_flight: InFlight) -> None:
        """Hands the batch to ``in_flight`` with an event recorded now on the current stream."""
        if self.tensors is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            in_flight.add(event, self.tensors)
            self.tensors = None

    def settle(self, in_flight: InFlight) -> None:
        """A loader's finaliser: its copies complete before their host batches may be reused."""
        try:
            self.cover(in_flight)
            in_flight.wait_all()
        except Exception:
            pass  # at interpreter exit CUDA may be gone, and with it every copy


Device = Union[None, str, int, torch.device]  # where batches go: None or "cpu", else a CUDA device


class TorchLoader:
    """The batches of ``source`` (a :class:`~extsrc.ParallelSource`) as torch tensors: per output
    one tensor ``(batch, *sample_shape)``, or a list of per-sample tensors where samples differ;
    a tuple for several outputs. Each ``for`` loop is one epoch, one loop at a time (a new
    ``iter()``, ``load_state_dict()`` or ``close()`` ends the running one); an interrupt inside
    ``next()`` loses no batch. ``device=None``: views of the shared memory; ``pin_memory=True``:
    that memory page-locked for CUDA once; ``device="cuda"``: each batch copied on a side stream
    while the previous one is in use. ``state_dict()`` / ``load_state_dict()`` save and restore
    the next batch a loop would get; ``close()`` (or ``with``) leaves ``source`` open. See
    ``docs/pytorch.md``.
    """

    def __init__(self, source: ParallelSource, *, device: Device = None, pin_memory: bool = False):
        self._setup(source, device, pin_memory, rebuild=None, owns_source=False)

    @classmethod
    def _owning(cls, source: ParallelSource, *, device: Device, pin_memory: bool,
                rebuild: Optional[Callable[[Any], Any]]) -> "TorchLoader":
        """A loader that closes ``source`` with itself and shapes each batch with ``rebuild``."""
        loader = cls.__new__(cls)
        try:
            loader._setup(source, device, pin_memory, rebuild, owns_source=True)
        except BaseException:
            source.close()
            raise
        return loader

    def _setup(self, source: ParallelSource, device: Device, pin_memory: bool,
               rebuild: Optional[Callable[[Any], Any]], owns_source: bool) -> None:
        if not isinstance(source, ParallelSource):
            raise TypeError(f"source must be an extsrc.ParallelSource, got {type(source).__name__}")
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be True or False, got {pin_memory!r}")
        self._source = source
        self._owns_source = owns_source
        self._rebuild = rebuild
        self._device = parse_device(device)
        self._pin = pin_memory
        self._page_lock: Optional[PageLock] = None
        self._stream: Any = None
        self._position: Optional[LoopPosition] = None  # of the running epoch (not the epoch: no cycle)
        self._closed = False  # close() began: iter() refuses
        self._closed_fully = False  # close() ran to its end
        self._in_flight = InFlight()
        self._handed = _Handed()
        self._finalizer = weakref.finalize(self, self._handed.settle, self._in_flight)
        if self._device is None and not pin_memory:
            return
        source.start()  # fork workers must exist before CUDA is initialised
        self._cuda = cuda_device(self._device, "device=" + repr(device) if self._device is not None
                                 else "pin_memory=True")
        self._handed.device = self._cuda
        if self._device is not None:
            self._device = self._cuda
            self._stream = torch.cuda.Stream(self._cuda)
        if pin_memory:
            self._page_lock = _page_lock_with_torch(source, self._cuda.index)

    @property
    def source(self) -> ParallelSource:
        """The source whose batches this loader yields."""
        return self._source

    @property
    def device(self) -> torch.device:
        """Where the tensors are: ``cpu`` or a CUDA device."""
        return self._device if self._device is not None else torch.device("cpu")

    @property
    def pin_memory(self) -> bool:
        """Whether the source's shared memory is page-locked for CUDA."""
        return self._pin

    def __len__(self) -> int:
        """Batches per epoch (the source's ``len()``; needs ``order=``)."""
        return len(self._source)

    def __iter__(self) -> "_Epoch":
        """Starts the source's next epoch (ending an unfinished one) and returns its iterator."""
        if self._closed:
            raise ValueError("this TorchLoader is closed")
        batches = iter(self._source)
        self.end_loop("a newer iter(loader)")
        start = self._source.get_state()  # the new epoch, before its first batch
        epoch: _Epoch = (_DeviceEpoch if self._device is not None else _HostEpoch)(self, batches, start)
        self._position = epoch.position
        return epoch

    def _tensors(self, batch: Any) -> Any:
        tensors = batch_tensors(batch)
        return tensors if self._rebuild is None else self._rebuild(tensors)

    def state_dict(self) -> Dict[str, Any]:
        """Where the loader stands: the next batch a loop would get (a small JSON-able dict)."""
        state = self._source.get_state()
        position = self._position
        if position is not None and not position.finished:
            state = position.state(state)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Makes the next ``iter()`` resume at ``state_dict`` (from :meth:`state_dict`);
        ``ValueError`` for another state, or one saved with another order."""
        self._source.set_state(state_dict)
        self.end_loop("load_state_dict()")
        self._position = None

    @property
    def position(self) -> Optional[LoopPosition]:
        """Where the running loop stands; None before the first, after ``load_state_dict()`` or ``close()``."""
        return self._position

    def end_loop(self, why: str) -> None:
        """Ends the running loop: its next ``next()`` raises, saying it was ended by ``why``."""
        if self._position is not None:
            self._position.ended_by = why

    def close(self) -> None:
        """Waits for the copies in flight; closes the source if the loader made it. Idempotent."""
        if self._closed_fully:
            return
        self._closed = True  # from here, an interrupted close() is finished by the next one
        self.end_loop("close()")
        self._position = None
        self._finalizer()
        if self._owns_source:
            self._source.close()
        self._closed_fully = True

    def __enter__(self) -> "TorchLoader":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TorchLoader({self._source.name}, device={str(self.device)!r}, pin_memory={self._pin})"


def _page_lock_with_torch(source: ParallelSource, index: int) -> PageLock:
    cudart = torch.cuda.cudart()

    def register(address: int, size: int) -> None:
        with torch.cuda.device(index):  # the mapping thread may have another device current
            torch.cuda.check_error(cudart.cudaHostRegister(address, size, CUDA_HOST_REGISTER_PORTABLE))

    def unregister(address: int) -> None:
        with torch.cuda.device(index):
            torch.cuda.check_error(cudart.cudaHostUnregister(address))

    return page_lock(source, "PyTorch", register, unregister)


class _Epoch:
    """One epoch of a loader: what ``iter(loader)`` returns."""

    def __init__(self, loader: TorchLoader, batches: Any, start: Dict[str, Any]):
        self.loader = loader
        self.batches = batches
        self.position = LoopPosition.of(loader.source, batches, start)
        # A batch taken from the source and not yet handed on: an interrupt (KeyboardInterrupt)
        # arriving in between leaves it here, and the next call hands it on.
        self._taken: Any = None

    def _next_host(self) -> Any:
        """The next batch as host tensors (the one taken before, if not handed on), or
        StopIteration; the caller clears ``_taken`` once the batch is handed on."""
        if self._taken is None:
            # __next__() rather than next(): the builtin returns into C, where an interrupt can
            # discard the batch it took (see extsrc.engine.take).
            try:
                self._taken = self.batches.__next__()
            except StopIteration:
                raise
            except Exception:
                if self.batches.goes_on():  # a batch's error, raised in its place: past it
                    self.position.handed(self.batches.last_given)
                raise
        try:
            return self.loader._tensors(self._taken)
        except Exception:
            # A batch that cannot be made tensors is raised once, in its place, not again; the
            # source's epoch goes on after it.
            self.position.handed(self.batches.last_given)
            self._taken = None
            raise

    def __iter__(self) -> "_Epoch":
        return self

    def __len__(self) -> int:
        return len(self.loader)

    def ready(self) -> bool:
        """Whether ``__next__()`` returns or raises at once rather than wait for the workers."""
        position = self.position
        return (self._taken is not None or position.finished or position.ended_by is not None
                or self.batches.ready())

    def _check(self) -> None:
        ended_by = self.position.ended_by
        if ended_by == "close()":
            raise ValueError("this TorchLoader is closed")
        if ended_by is not None:
            raise RuntimeError(f"this loop over the TorchLoader was ended by {ended_by} before the end of its "
                               "epoch: a loader runs one loop at a time (as its source does); finish or "
                               "leave a loop before starting the next")
        if self.loader._page_lock is not None:
            self.loader._page_lock.check()


class _HostEpoch(_Epoch):
    """CPU tensors, views of the batches' shared memory."""

    def __next__(self) -> Any:
        loader = self.loader
        if self.position.finished:
            raise StopIteration
        self._check()
        if loader._pin:
            loader._handed.cover(loader._in_flight)  # the previous batch, copied by now or queued
            loader._in_flight.release_done()
        try:
            tensors = self._next_host()
        except StopIteration:
            self.position.finished = True
            raise
        if loader._pin:
            loader._handed.tensors = tensors
        self.position.handed(self.batches.last_given)
        self._taken = None  # handed on
        return tensors


class _DeviceEpoch(_Epoch):
    """CUDA tensors, each batch copied on the loader's side stream while the previous one is used."""

    def __init__(self, loader: TorchLoader, batches: Any, start: Dict[str, Any]):
        super().__init__(loader, batches, start)
        self._ready: Any = None  # (CUDA tensors, event) of the next batch, copying or copied
        self._exhausted = False
        self._error: Optional[BaseException] = None  # raised after the batches before it

    def ready(self) -> bool:
        return (self._ready is not None or self._error is not None or self._exhausted
                or super().ready())

    def _copy_next(self) -> Any:
        """Takes the next host batch and queues its copy; raises StopIteration at the end."""
        loader = self.loader
        host = self._next_host()
        with torch.cuda.stream(loader._stream):
            device = map_tensors(lambda t: t.to(loader._device, non_blocking=True), host)
            event = torch.cuda.Event()
            event.record(loader._stream)
        loader._in_flight.add(event, host)  # the host memory is not reused before the copy is done
        return device, event, self.batches.last_given

    def __next__(self) -> Any:
        if self.position.finished:
            raise StopIteration
        self._check()
        self.loader._in_flight.release_done()
        if self._ready is None:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._exhausted:
                self.position.finished = True
                raise StopIteration
            try:
                self._ready = self._copy_next()
            except StopIteration:
                self.position.finished = True
                raise
            self._taken = None
        current = self._ready
        upcoming = None
        if not self._exhausted and self._error is None:
            try:
                upcoming = self._copy_next()  # overlaps with the loop's work on `current`
            except StopIteration:
                self._exhausted = True
            except Exception as exc:
                self._error = exc
        device, event, iteration = current
        stream = torch.cuda.current_stream(self.loader._device)
        stream.wait_event(event)
        for tensor in each_tensor(device):
            tensor.record_stream(stream)  # allocated on the side stream, used on this one
        # Handed on from here, with no call before the return: an interrupt (KeyboardInterrupt)
        # above leaves `current` ready and the upcoming host batch taken, and the next call
        # returns `current` and copies that batch again.
        self.position.handed(iteration)
        self._ready = upcoming
        self._taken = None
        return device
