"""The loaders a cell can run, each on a bench workload: open it, take batches, close it.

Every opener returns ``(take, indices, close)``: ``take()`` returns the next
batch (after touching it as a consumer would), ``indices(batch)`` the sample
indices it holds (to check the loader delivered the right samples), and
``close()`` stops it. PyTorch and DALI are imported here only, inside the
cells' own processes.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from benchmarks.measure import Take
from benchmarks.workloads import ALL_WORKLOADS, TORCH_SHAPED

WORKERS = 2
DALI_THREADS = 1  # num_threads of the DALI pipelines (DALI requires a value)
STARTUP_WORKERS = 4  # workers of the startup cells (build() to the first batch, spawn)

# Loader names used by the cells.
EXTSRC, TORCH, DALI, EXTSRC_DALI = "extsrc", "torch", "dali", "extsrc-dali"
EXTSRC_SHUFFLED, EXTSRC_IDENTITY = "extsrc-shuffled-order", "extsrc-identity-order"
EXTSRC_NO_STATS = "extsrc-no-stats"  # ParallelSource(..., stats=False)
EXTSRC_FROM_DATASET = "extsrc-from-dataset"  # extsrc.torch.from_dataset on the DataLoader cell's dataset
# The same, both with a user's collate_fn (stack_collate), and both on an IterableDataset.
TORCH_COLLATE, EXTSRC_FROM_DATASET_COLLATE = "torch-collate", "extsrc-from-dataset-collate"
TORCH_ITERABLE, EXTSRC_FROM_DATASET_ITERABLE = "torch-iterable", "extsrc-from-dataset-iterable"
# Both without workers (num_workers=0): the dataset and the collation in the consuming process.
TORCH_INLINE, EXTSRC_FROM_DATASET_INLINE = "torch-inline", "extsrc-from-dataset-inline"
READY = "ready"  # no loader: the same prepared batch each step (benchmarks.step)
STEP_CPU_S = 0.003  # a training step's CPU (benchmarks.step): long enough that loaders are not the limit
ORDER_RECORDS = 10 ** 9  # the order of the order rows: a large data set, never materialised

Opened = Tuple[Take, Callable[[Any], List[int]], Callable[[], None]]

def bench_order(loader: str) -> Any:
    """The order of an extsrc loader: ``None``, a shuffled or an identity ``extsrc.Order``."""
    import extsrc

    if loader == EXTSRC_SHUFFLED:
        return extsrc.Order(ORDER_RECORDS, shuffle=True, seed=1)
    if loader == EXTSRC_IDENTITY:
        return extsrc.Order(ORDER_RECORDS)
    return None

def expected_indices(loader: str, batch: int, batch_size: int, epoch_batches: Optional[int] = None) -> List[int]:
    """The sample indices batch ``batch`` of the stream must hold (of epoch 0, or of its epoch
    when epochs have ``epoch_batches`` batches)."""
    order = bench_order(loader)
    if epoch_batches is not None:
        batch %= epoch_batches
    positions = range(batch * batch_size, (batch + 1) * batch_size)
    return list(positions) if order is None else list(order.epoch(0)[positions.start:positions.stop])

def _open_extsrc(workload: str, workers: int, start_method: str, loader: str = EXTSRC) -> Opened:
    import extsrc
    from benchmarks.workloads import CALLBACKS, IN_PLACE_CALLBACKS, RECORD_CALLBACKS, sample_index

    order = bench_order(loader)
    callback = CALLBACKS[workload] if order is None else RECORD_CALLBACKS[workload]
    in_place = workload in IN_PLACE_CALLBACKS
    source = extsrc.ParallelSource(IN_PLACE_CALLBACKS.get(workload, callback),
                                   ALL_WORKLOADS[workload].batch_size, num_workers=workers,
                                   start_method=start_method, order=order, in_place=in_place,
                                   stats=loader != EXTSRC_NO_STATS)
    batches = iter(source)

    def take():
        batch = next(batches)
        batch[0][0]  # the consumer touches one byte
        return batch

    take.source = source  # type: ignore[attr-defined]  # for cells that look at the workers
    return take, lambda batch: [sample_index(sample) for sample in batch], source.close

def bench_dataset(workload: str):
    """What a user writes: a map-style dataset returning one NumPy sample (made here, as it
    needs torch)."""
    from torch.utils.data import Dataset

    class BenchDataset(Dataset):
        def __init__(self, name: str):
            self.workload = ALL_WORKLOADS[name]

        def __len__(self) -> int:
            return 1 << 40  # never exhausted within a cell

        def __getitem__(self, idx: int):
            return self.workload.make(idx)

    return BenchDataset(workload)

def torch_shaped_dataset(workload: str):
    """What PyTorch users' datasets return: a new 3x32x32 float32 tensor per sample holding its
    index, alone ("tensor") or as ``{"image": tensor, "label": index}`` ("dict")."""
    import torch
    from torch.utils.data import Dataset

    w = ALL_WORKLOADS[workload]

    class TorchShaped(Dataset):
        def __len__(self) -> int:
            return w.batch_size * (w.epoch_batches or 1)

        def __getitem__(self, idx: int):
            image = torch.full((3, 32, 32), float(idx % 251))
            image[0, 0, 0] = idx  # exact in float32 below 2**24
            return image if workload == "tensor" else {"image": image, "label": idx}

    return TorchShaped()


def _torch_indices(batch) -> List[int]:
    """The sample indices in a batch of any of the bench's datasets, as default_collate gives it."""
    from benchmarks.workloads import sample_index

    if isinstance(batch, dict):
        return [int(v) for v in batch["label"]]
    if isinstance(batch, list):  # keep_samples's
        return [sample_index(sample) for sample in batch]
    if batch.dtype.is_floating_point:
        return [int(v) for v in batch[:, 0, 0, 0]]
    return [sample_index(sample) for sample in batch.numpy()]


def _touched(batch) -> None:
    """The consumer touches one value."""
    if isinstance(batch, list):
        batch[0][0]
        return
    (batch["image"] if isinstance(batch, dict) else batch)[0, 0]


def _next_of(loader: Any, state: dict) -> Any:
    """The next batch of ``loader``'s loop in ``state``, a new loop at the end of an epoch."""
    try:
        return next(state["batches"])
    except StopIteration:
        state["batches"] = iter(loader)
        return next(state["batches"])


def keep_samples(samples):
    """A user's collate_fn for samples of changing sizes: the batch is the list of samples."""
    return samples


def stack_collate(samples):
    """A user's collate_fn: the samples (NumPy arrays) stacked into one tensor."""
    import numpy as np
    import torch

    return torch.from_numpy(np.stack(samples))


def _bench_iterable(workload: str):
    """What a user writes for a stream: an IterableDataset each worker shards by its id. Worker
    ``w`` of ``k`` yields the samples of batches ``w``, ``w + k``, ...: taken from the workers in
    turn, as DataLoader takes them, batch ``b`` holds samples ``b * batch_size`` on."""
    from torch.utils.data import IterableDataset, get_worker_info

    class BenchStream(IterableDataset):
        def __init__(self, name: str):
            self.workload = ALL_WORKLOADS[name]

        def __iter__(self):
            info = get_worker_info()
            worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
            size = self.workload.batch_size
            batch = worker
            while True:
                for idx in range(batch * size, (batch + 1) * size):
                    yield self.workload.make(idx)
                batch += workers

    return BenchStream(workload)


def collate_by_default(samples):
    """A user's collate_fn over tensors: ``default_collate``'s batch, which such a function
    usually goes on to change (a mask, a renamed key); here it changes nothing."""
    from torch.utils.data import default_collate

    return default_collate(samples)


def _loader_arguments(loader: str, workload: str) -> Tuple[Any, dict]:
    """The dataset and the DataLoader arguments of a DataLoader-style cell, beyond the common."""
    collates = loader in (TORCH_COLLATE, EXTSRC_FROM_DATASET_COLLATE)
    if workload in TORCH_SHAPED:
        return torch_shaped_dataset(workload), {"collate_fn": collate_by_default} if collates else {}
    if loader in (TORCH_ITERABLE, EXTSRC_FROM_DATASET_ITERABLE):
        return _bench_iterable(workload), {}
    if ALL_WORKLOADS[workload].ragged:  # default_collate cannot stack them
        return bench_dataset(workload), {"collate_fn": keep_samples}
    if collates:
        return bench_dataset(workload), {"collate_fn": stack_collate}
    return bench_dataset(workload), {}


def _open_torch(workload: str, workers: int, start_method: str, name: str = TORCH):
    from torch.utils.data import DataLoader

    dataset, extra = _loader_arguments(name, workload)
    loader = DataLoader(dataset, batch_size=ALL_WORKLOADS[workload].batch_size,
                        **_worker_arguments(name, workers, start_method), **extra)
    state = {"batches": iter(loader)}

    def take():
        batch = _next_of(loader, state)
        _touched(batch)
        return batch

    def close():
        state.clear()  # the iterator's finaliser shuts the persistent workers down

    return take, _torch_indices, close


def _worker_arguments(name: str, workers: int, start_method: str) -> dict:
    """DataLoader's arguments for the cell's workers (none for the inline loaders)."""
    if name in (TORCH_INLINE, EXTSRC_FROM_DATASET_INLINE):
        return {"num_workers": 0}
    return {"num_workers": workers, "persistent_workers": True, "multiprocessing_context": start_method}

def _open_from_dataset(workload: str, workers: int, start_method: str,
                       name: str = EXTSRC_FROM_DATASET):
    """The DataLoader cell's dataset and arguments, through extsrc.torch.from_dataset."""
    from extsrc.torch import from_dataset

    dataset, extra = _loader_arguments(name, workload)
    loader = from_dataset(dataset, batch_size=ALL_WORKLOADS[workload].batch_size,
                          **_worker_arguments(name, workers, start_method), **extra)
    state = {"batches": iter(loader)}

    def take():
        batch = _next_of(loader, state)
        _touched(batch)
        return batch

    return take, _torch_indices, loader.close

def _dali_pipeline(workload: str, workers: int, start_method: str, dropin: bool, consumed: bool = False):
    """The same pipeline code for both: only the import differs."""
    if dropin:
        from extsrc import fn, pipeline_def
    else:
        from nvidia.dali import fn, pipeline_def
    from benchmarks.workloads import CALLBACKS, IN_PLACE_CALLBACKS

    # The drop-in writes in place where the workload says so (an extsrc option); DALI cannot.
    in_place = dropin and workload in IN_PLACE_CALLBACKS
    callback = IN_PLACE_CALLBACKS[workload] if in_place else CALLBACKS[workload]
    extra = {"in_place": True} if in_place else {}

    @pipeline_def(batch_size=ALL_WORKLOADS[workload].batch_size, num_threads=DALI_THREADS, device_id=None,
                  py_num_workers=workers, py_start_method=start_method)
    def pipeline():
        samples = fn.external_source(source=callback, batch=False, parallel=True, **extra)
        return samples[0:8] if consumed else samples

    return pipeline

def dali_indices(output) -> List[int]:
    """The sample indices a DALI pipeline's output batch holds."""
    import numpy as np

    from benchmarks.workloads import sample_index

    return [sample_index(np.asarray(output[k])) for k in range(len(output))]

def _open_dali(workload: str, workers: int, start_method: str, dropin: bool, consumed: bool = False):
    pipe = _dali_pipeline(workload, workers, start_method, dropin, consumed)()
    pipe.build()
    state = {"pipe": pipe}

    def take():
        (output,) = state["pipe"].run()
        len(output)  # the consumer touches the batch
        return output

    def close():
        state.clear()

    return take, dali_indices, close

def open_loader(loader: str, workload: str, workers: int, start_method: str,
                consumed: bool = False) -> Opened:
    """Opens ``loader`` on ``workload``; see the module docstring."""
    if loader in (EXTSRC, EXTSRC_SHUFFLED, EXTSRC_IDENTITY, EXTSRC_NO_STATS):
        return _open_extsrc(workload, workers, start_method, loader)
    if loader in (TORCH, TORCH_COLLATE, TORCH_ITERABLE, TORCH_INLINE):
        return _open_torch(workload, workers, start_method, loader)
    if loader in (EXTSRC_FROM_DATASET, EXTSRC_FROM_DATASET_COLLATE, EXTSRC_FROM_DATASET_ITERABLE,
                  EXTSRC_FROM_DATASET_INLINE):
        return _open_from_dataset(workload, workers, start_method, loader)
    if loader in (DALI, EXTSRC_DALI):
        return _open_dali(workload, workers, start_method, dropin=loader == EXTSRC_DALI, consumed=consumed)
    raise ValueError(f"unknown loader {loader!r}")
