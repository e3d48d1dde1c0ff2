"""Importable sources and helpers for the DALI-layer tests (spawned workers import them)."""

from __future__ import annotations

import os
import time

import numpy as np


def samples_of(tensor_list) -> list:
    """The samples of a DALI CPU TensorList as NumPy copies."""
    return [np.array(tensor_list[i]) for i in range(len(tensor_list))]


def run_epoch(pipe) -> list:
    """Runs ``pipe`` until StopIteration; returns per iteration a tuple of per-output sample lists."""
    iterations = []
    while True:
        try:
            outputs = pipe.run()
        except StopIteration:
            return iterations
        iterations.append(tuple(samples_of(out) for out in outputs))


def as_lists(iterations) -> list:
    """Nested plain lists, for == comparisons in asserts."""
    return [[[s.tolist() for s in out] for out in it] for it in iterations]


class Counting:
    """Sample source: [idx_in_epoch, idx_in_batch, iteration, epoch_idx]; ends after ``n`` samples."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, info):
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        return np.array(
            [info.idx_in_epoch, info.idx_in_batch, info.iteration, info.epoch_idx], dtype=np.int64
        )


class ImageAndLabel:
    """Two outputs: an HWC uint8 image (shape varies with the sample) and an int32 label."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, info):
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        i = info.idx_in_epoch
        image = np.full((2 + i % 3, 3, 3), i, dtype=np.uint8)
        return image, np.array([i * 10 + info.epoch_idx], dtype=np.int32)


class BatchOfIteration:
    """Batch source taking the iteration (or BatchInfo); ``n_iters`` batches per epoch.

    Returns a list of samples, or one array (``dense=True``; DALI 2.4's own
    parallel mode fails on those, in its worker).
    """

    def __init__(self, batch_size: int, n_iters: int, dense: bool = False):
        self.batch_size = batch_size
        self.n_iters = n_iters
        self.dense = dense

    def __call__(self, arg):
        iteration = arg if isinstance(arg, int) else arg.iteration
        epoch = 0 if isinstance(arg, int) else arg.epoch_idx
        if iteration >= self.n_iters:
            raise StopIteration
        samples = [np.array([iteration, k, epoch], dtype=np.int64) for k in range(self.batch_size)]
        return np.stack(samples) if self.dense else samples


def batches_generator():
    """Generator function: three ragged batches of two samples."""
    for i in range(3):
        yield [np.arange(i + 1, dtype=np.int32), np.arange(i + 2, dtype=np.int32)]


def worker_pid(info):
    return np.array([os.getpid()], dtype=np.int64)


def fails_at_5(info):
    if info.idx_in_epoch == 5:
        raise KeyError("no record for sample 5 in the index")
    return np.array([info.idx_in_epoch], dtype=np.int64)


def dies_at_3(info):
    if info.idx_in_epoch == 3:
        os._exit(3)
    return np.array([info.idx_in_epoch], dtype=np.int64)


def returns_a_string(info):
    return "not an array"


def float_sample(info):
    return np.zeros((2,), dtype=np.float64)


def sleeps(info):
    time.sleep(30)
    return np.zeros((1,), dtype=np.int64)


def extsrc_workers() -> list:
    """The pids of this process's children still alive (extsrc workers, with no other children)."""
    from procs import live_children

    return live_children()


class RewindingBatches:
    """Batch iterable whose ``__iter__`` rewinds it and returns the object itself (the way
    DALI's own tests write re-iterable sources); ``n_batches`` batches per pass, stamped with
    the pass number."""

    def __init__(self, batch_size: int, n_batches: int):
        self.batch_size = batch_size
        self.n_batches = n_batches
        self.passes = -1
        self.position = 0

    def __iter__(self):
        self.passes += 1
        self.position = 0
        return self

    def __next__(self):
        if self.position >= self.n_batches:
            raise StopIteration
        batch = [np.array([self.passes, self.position, k], np.int64) for k in range(self.batch_size)]
        self.position += 1
        return batch


class OnePassBatches(RewindingBatches):
    """Like RewindingBatches, but iter() does not rewind: one pass, ever."""

    def __iter__(self):
        return self


class PicklerRefusingKwargs:
    """A pickler (dumps/loads) that raises ValueError when dumps gets no ``token=7``."""

    @staticmethod
    def dumps(obj, **kwargs):
        import pickle

        if kwargs.get("token") != 7:
            raise ValueError(f"this pickler needs token=7, got {kwargs}")
        return pickle.dumps(obj)

    @staticmethod
    def loads(data, **kwargs):
        import pickle

        return pickle.loads(data)


def echo_argument(arg):
    """Batch of two samples saying how it was called: [1, iteration] for an int argument,
    [2, iteration] for a BatchInfo, [3, idx_in_epoch] for a SampleInfo."""
    if isinstance(arg, int):
        return [np.array([1, arg], np.int64)] * 2
    if hasattr(arg, "idx_in_epoch"):
        return np.array([3, arg.idx_in_epoch], np.int64)
    return [np.array([2, arg.iteration], np.int64)] * 2


class FileListSource:
    """A sample callable as DALI's parallel external source tutorial writes it: reads
    ``file_list.txt`` ("name label" lines) in ``folder``, returns (encoded bytes, int32 label)
    for ``idx_in_epoch``, and ends the epoch (StopIteration) after the last full batch."""

    def __init__(self, folder: str, batch_size: int):
        self.folder = folder
        with open(os.path.join(folder, "file_list.txt")) as f:
            pairs = [line.split() for line in f if line.strip()]
        self.files = [p[0] for p in pairs]
        self.labels = [int(p[1]) for p in pairs]
        self.full_iterations = len(self.files) // batch_size

    def __call__(self, sample_info):
        if sample_info.iteration >= self.full_iterations:
            raise StopIteration
        i = sample_info.idx_in_epoch
        with open(os.path.join(self.folder, self.files[i]), "rb") as f:
            encoded = np.frombuffer(f.read(), dtype=np.uint8)
        return encoded, np.array([self.labels[i]], dtype=np.int32)


def index_sample(info):
    """Sample source: [idx_in_epoch] (tests rename it to see how it is pickled)."""
    return np.array([info.idx_in_epoch], dtype=np.int64)


def marked_index_sample(info):
    """As ``index_sample``; the tests mark it with DALI's ``pickle_by_value``."""
    return np.array([info.idx_in_epoch], dtype=np.int64)
