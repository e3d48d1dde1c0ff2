"""Importable callbacks for the tests (spawned workers import them by reference)."""

from __future__ import annotations

import os
import random
import time

import numpy as np


def sample_of(info):
    """A sample that encodes where it came from: [idx_in_epoch, idx_in_batch, iteration, epoch]."""
    return np.array(info[:4], dtype=np.int64)


def jittered(info):
    """Like :func:`sample_of`, after a random delay, so workers finish out of order."""
    time.sleep(random.random() * 0.004)
    return np.array(info[:4], dtype=np.int64)


class StopsAt:
    """Ends the epoch at sample ``n`` (callable class, so it pickles by reference)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, info):
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        return np.array(info[:4], dtype=np.int64)


class CalledSample:
    """A callback object, as DALI's examples write them: its ``__call__`` gives ``sample_of``
    shifted by ``offset``."""

    def __init__(self, offset: int):
        self.offset = offset

    def __call__(self, info):
        return sample_of(info) + self.offset


class CalledSampleSubclass(CalledSample):
    pass


class StaticCall:
    @staticmethod
    def __call__(info):
        return sample_of(info) + 2


class ClassCall:
    offset = 3

    @classmethod
    def __call__(cls, info):
        return sample_of(info) + cls.offset


def two_outputs(info):
    """An image-like uniform output and a ragged label list."""
    image = np.full((2, 3), info.idx_in_epoch, dtype=np.uint8)
    ragged = np.arange(info.idx_in_batch + 1, dtype=np.float32)
    return image, ragged


def batch_of_iteration(iteration):
    return [np.full((3,), iteration * 10 + k, np.int32) for k in range(4)]


def pid_sample(info):
    return np.array([os.getpid()], np.int64)


def records_and_draws(info):
    """[record, a draw of the sample's rng]: what a loader with an augmentation would depend on."""
    return np.array([info.record, info.rng.integers(1 << 40)], dtype=np.int64)


def large_sample(info):
    """1 MiB per sample: each is written on its own (streaming writes), not with its task's others."""
    return np.full(1 << 20, info.idx_in_epoch % 251, np.uint8)


def filling_two_outputs(info, buffers):
    """``two_outputs`` written in place (``in_place=True``): an image and a ragged output."""
    image = buffers.array((2, 3), np.uint8)
    image[...] = info.idx_in_epoch
    ragged = buffers.array(info.idx_in_batch + 1, np.float32, output=1)
    ragged[:] = np.arange(info.idx_in_batch + 1)
    return image, ragged


class ReusesItsBuffers:
    """Returns views of one buffer per process that the next batch's samples overwrite, as
    callbacks that recycle their memory do: sample ``k`` of a batch is row ``k``, filled with the
    sample's index. ``ragged``: rows of varying length; ``sample_bytes``: the full row length."""

    def __init__(self, batch_size: int, sample_bytes: int, ragged: bool = False):
        self.batch_size, self.sample_bytes, self.ragged = batch_size, sample_bytes, ragged
        self.rows = None

    def __getstate__(self):
        return {**self.__dict__, "rows": None}

    def __call__(self, info):
        if self.rows is None:
            self.rows = np.zeros((self.batch_size, self.sample_bytes), np.int64)
        row = self.rows[info.idx_in_batch]
        row[:] = info.idx_in_epoch
        return row[: self.sample_bytes - info.idx_in_batch] if self.ragged else row


class ReusesItsBatch:
    """Batch mode: every batch is the same array (``batch_size`` rows of ``sample_bytes`` int64
    values), refilled with the iteration's number, as a loader with one staging buffer does."""

    def __init__(self, batch_size: int, sample_bytes: int, batches: int):
        self.batch_size, self.sample_bytes, self.batches = batch_size, sample_bytes, batches
        self.buffer = None

    def __getstate__(self):
        return {**self.__dict__, "buffer": None}

    def __call__(self, info):
        if info.iteration >= self.batches:
            raise StopIteration
        if self.buffer is None:
            self.buffer = np.zeros((self.batch_size, self.sample_bytes // 8), np.int64)
        self.buffer[:] = info.iteration
        return self.buffer


def with_empty_samples(info):
    """Two outputs: a ragged one whose samples are empty in every other batch (from the first
    batch on, so that the first spilled sample of a slot is empty) and a uint8 one of 0-d values."""
    k = info.idx_in_epoch
    length = 0 if info.iteration % 2 == 0 else k % 5
    return np.arange(length, dtype=np.int16) + k, np.uint8(k % 251)


VARYING_SAMPLE_BYTES = (0, 10, 200_000, 900_000, 50, 2_500_000, 3, 120_000)


def varying_sizes(info):
    """Three outputs whose sizes jump from batch to batch (empty, bytes, hundreds of KiB, MiB,
    back to bytes), so that what a batch weighs says little about the next; a 0-d output and a
    non-contiguous one."""
    k = info.idx_in_epoch
    length = VARYING_SAMPLE_BYTES[info.iteration % len(VARYING_SAMPLE_BYTES)] + k % 3
    rng = np.random.default_rng(k)
    return (rng.integers(0, 255, length, dtype=np.uint8), np.float32(k),
            rng.random((k % 7, 3))[:, ::2])


def auto_outputs(info):
    """Samples of three outputs (a vector, a scalar, a ragged range), for num_outputs='auto'."""
    i = info.idx_in_epoch
    return np.full((3,), i, np.int32), np.float64(i), np.arange(i % 3)


def outputs_change_at_5(info):
    """Two outputs, three from sample 5 on."""
    i = info.idx_in_epoch
    return (np.int64(i),) * (3 if i >= 5 else 2)


class RecordsWorkerStart:
    """A worker_init that records, in the worker's process, what it was called with; the
    callback returns it with each sample."""

    def __init__(self):
        self.started = None

    def __call__(self, worker_index, num_workers):
        self.started = (worker_index, num_workers, os.getpid())


class ReturnsWorkerStart:
    def __init__(self, start: RecordsWorkerStart):
        self.start = start

    def __call__(self, info):
        return np.array(self.start.started if self.start.started else (-1, -1, os.getpid()), np.int64)


def outputs_by_iteration(info):
    """Three outputs in batch 1, two elsewhere (with 2 workers: another count per worker)."""
    return (np.int64(info.idx_in_epoch),) * (3 if info.iteration == 1 else 2)


class HeldBack:
    """:func:`sample_of`, but the samples of the batches in ``held`` wait until the file
    ``release`` exists, and those of the batches in ``ends`` raise StopIteration (after the wait,
    if held too): a batch the test holds back for as long as it likes, without timing. Sample
    ``float_at`` is float64, the others int64."""

    def __init__(self, release: str, held, batch_size: int, ends=(), float_at: int = -1):
        self.release = release
        self.held = frozenset(held)
        self.batch_size = batch_size
        self.ends = frozenset(ends)
        self.float_at = float_at  # this sample is float64: its batch cannot be made one array

    def __call__(self, info):
        iteration = info.idx_in_epoch // self.batch_size
        if iteration in self.held:
            while not os.path.exists(self.release):
                time.sleep(0.005)
        if iteration in self.ends:
            raise StopIteration
        return np.array(info[:4], dtype=np.float64 if info.idx_in_epoch == self.float_at else np.int64)


def http_404_urllib(info):
    """Raises what urllib raises for a missing object: an HTTPError, whose __init__ takes
    arguments its args lack (a plain pickle cannot rebuild it)."""
    import email.message
    import io
    import urllib.error

    raise urllib.error.HTTPError(f"http://store/{info.idx_in_epoch}", 404, "Not Found",
                                 email.message.Message(), io.BytesIO(b"no such object"))


def http_404_aiohttp(info):
    """Raises what aiohttp's raise_for_status() raises for a missing object: a
    ClientResponseError, whose request_info holds headers that do not pickle."""
    import aiohttp
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    url = URL(f"http://store/{info.idx_in_epoch}")
    request = aiohttp.RequestInfo(url, "GET", CIMultiDictProxy(CIMultiDict(Accept="*/*")), url)
    raise aiohttp.ClientResponseError(request, (), status=404, message="Not Found")


class MarksOnce:
    """:func:`sample_of`, leaving a file named ``<epoch>-<index>`` per sample made, created
    exclusively: a sample made twice fails its batch (FileExistsError). The test sees how many
    samples the workers made, and that none was made again, whatever the start method."""

    def __init__(self, directory: str):
        self.directory = directory

    def __call__(self, info):
        os.close(os.open(os.path.join(self.directory, f"{info.epoch_idx}-{info.idx_in_epoch}"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return np.array(info[:4], np.int64)


def wait_for_files(directory: str, count: int, deadline_s: float = 120) -> int:
    """How many files ``directory`` holds once it holds ``count`` (or the deadline passed, which
    only a broken feature reaches)."""
    deadline = time.monotonic() + deadline_s
    while len(os.listdir(directory)) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(os.listdir(directory))


class FailsOn:
    """Records ``0..n-1`` (each sample: the record, twice, and a ragged tail by parity); raises
    ``OSError`` naming the record for those in ``bad``, as a corrupt file would."""

    def __init__(self, n: int, bad, outputs: int = 1):
        self.n, self.bad, self.outputs = n, frozenset(bad), outputs

    def __call__(self, info):
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        record = info.record
        if record in self.bad:
            raise OSError(f"cannot decode record {record}")
        sample = np.array([record, record], dtype=np.int64)
        return sample if self.outputs == 1 else (sample, np.arange(record % 3, dtype=np.float32))


def minus_record(info, error):
    """An ``on_error`` replacement: the record, negated, in the sample's shape."""
    return np.array([-info.record, -info.record], dtype=np.int64)


class KillsItsWorker:
    """Records ``0..n-1``; at record ``at`` the worker SIGKILLs itself, each time a file of
    ``marks`` is left (one is removed per kill: the new worker then goes on), or every time
    when ``marks`` is None."""

    def __init__(self, n: int, at: int, marks=None):
        self.n, self.at, self.marks = n, at, marks

    def __call__(self, info):
        import glob
        import signal

        if info.idx_in_epoch >= self.n:
            raise StopIteration
        if info.idx_in_epoch == self.at:
            left = sorted(glob.glob(os.path.join(self.marks, "kill-*"))) if self.marks else [None]
            if left:
                if left[0] is not None:
                    os.unlink(left[0])
                os.kill(os.getpid(), signal.SIGKILL)
        return np.full(2, info.idx_in_epoch, np.int64)


async def async_until_16(info):
    """An ``async def`` source of 16 records (its StopIteration ends the epoch)."""
    if info.idx_in_epoch >= 16:
        raise StopIteration
    return np.full(2, info.idx_in_epoch, np.int64)


class RaggedKillsAt:
    """Records ``0..n-1``, sample ``r`` of ``1 + r % 5`` values ``r`` (ragged: written to the
    workers' overflow); the worker SIGKILLs itself at record ``at`` while a ``kill-*`` file is
    left in ``marks`` (one removed per kill)."""

    def __init__(self, n: int, at: int, marks: str):
        self.n, self.at, self.marks = n, at, marks

    def __call__(self, info):
        import glob
        import signal

        record = info.idx_in_epoch
        if record >= self.n:
            raise StopIteration
        time.sleep(0.01)
        if record == self.at:
            left = glob.glob(os.path.join(self.marks, "kill-*"))
            if left:
                os.unlink(left[0])
                os.kill(os.getpid(), signal.SIGKILL)
        return np.full(1 + record % 5, record, np.int64)
