"""Importable map-style datasets for the extsrc.torch tests (spawned workers import them)."""

from __future__ import annotations

import collections
import os

import numpy as np
import torch

Pair = collections.namedtuple("Pair", ["image", "label"])


def collated_alone(samples):
    """The collate_fn the errors for fields that change name: each batch collated on its own."""
    return torch.utils.data.default_collate(samples)


class Records(torch.utils.data.Dataset):
    """Sample i in the layout ``kind``: an image-like tensor, a Python int, a float, ..."""

    def __init__(self, n: int, kind: str = "tuple"):
        self.n = n
        self.kind = kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        image = torch.full((2, 3), i, dtype=torch.uint8)
        if self.kind == "tuple":
            return image, i, float(i) / 2
        if self.kind == "list":
            return [np.full((4,), i, np.float32), np.int16(i)]
        if self.kind == "dict":
            return {"image": image, "label": i, "weight": np.float32(i) / 4, "flag": i % 2 == 0}
        if self.kind == "namedtuple":
            return Pair(image, torch.tensor(i))
        if self.kind == "single":
            return np.arange(3, dtype=np.int64) + i
        if self.kind == "nested":
            return {"path": f"/data/{i}.jpg", "meta": {"size": (i, 2 * i), "scale": i / 4}, "image": image,
                    "tags": [f"t{i}", b"raw"]}
        raise ValueError(self.kind)


class Ragged(torch.utils.data.Dataset):
    """Sample i: a sequence of i % 3 + 1 values, and its label."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        return torch.arange(i % 3 + 1, dtype=torch.float32) + i, i


class Draws(torch.utils.data.Dataset):
    """Sample i: draws of the global generators (random augmentation) and the worker's pid."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        import random

        return np.array([np.random.randint(1 << 30), random.randrange(1 << 30),
                         int(torch.randint(1 << 30, ())), os.getpid()], np.int64)


class Changing(torch.utils.data.Dataset):
    """Sample 5 has three fields where the others have two."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return (i, i, i) if i == 5 else (i, i)


class ShardedStream(torch.utils.data.IterableDataset):
    """Records 0..n-1, each worker yielding every num_workers-th from its id on (as DataLoader
    users shard); or, once a worker_init_fn set ``start``/``step``, those."""

    def __init__(self, n: int):
        self.n = n
        self.start = self.step = None

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if self.start is not None:
            start, step = self.start, self.step
        else:
            start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"x": torch.full((3,), i), "i": i, "name": f"#{i}"}


def shard_by_worker_init(worker_id):
    info = torch.utils.data.get_worker_info()
    info.dataset.start, info.dataset.step = worker_id, info.num_workers


def _wait_for(path: str) -> None:
    import time

    while not os.path.exists(path):
        time.sleep(0.005)


class HeldBackRecords(torch.utils.data.Dataset):
    """Records(n)'s tensors and labels; the records in ``held`` wait until the file ``release``
    exists, and ``dataset[fails]`` raises ValueError: a slow batch (or a failing one) the test
    controls without timing."""

    def __init__(self, n: int, release: str, held, fails: int = -1):
        self.n = n
        self.release = release
        self.held = frozenset(held)
        self.fails = fails

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i in self.held:
            _wait_for(self.release)
        if i == self.fails:
            raise ValueError(f"record {i} is damaged")
        return torch.full((2,), i), i


class HeldBackStream(torch.utils.data.IterableDataset):
    """Records 0..n-1 sharded by worker; worker 0 waits before its first record until the file
    ``release`` exists."""

    def __init__(self, n: int, release: str):
        self.n = n
        self.release = release

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, self.n, info.num_workers):
            if i == 0:
                _wait_for(self.release)
            yield torch.tensor(i)


class OddKeyRecords(torch.utils.data.Dataset):
    """``{"x": tensor([i])}``, but record ``odd`` is ``{"z": ...}``: its batch cannot be
    collated (found in the loop's process); the records in ``held`` wait for the file
    ``release``."""

    def __init__(self, n: int, odd: int, release: str, held=()):
        self.n, self.odd, self.release, self.held = n, odd, release, frozenset(held)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i in self.held:
            _wait_for(self.release)
        return {"z" if i == self.odd else "x": torch.tensor([i])}


class FailsAt(torch.utils.data.Dataset):
    """``tensor([i])`` for n records; ``dataset[fails]`` raises ValueError."""

    def __init__(self, n: int, fails: int):
        self.n, self.fails = n, fails

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fails:
            raise ValueError(f"record {i} is damaged")
        return torch.tensor([i])


class KillsOnce(torch.utils.data.Dataset):
    """``Records(n, "dict")``, whose worker SIGKILLs itself at index ``at`` while the file
    ``mark`` exists (removed first: the worker in its place goes on)."""

    def __init__(self, n: int, at: int, mark: str):
        self.records, self.at, self.mark = Records(n, "dict"), at, mark

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        if i == self.at and os.path.exists(self.mark):
            import signal

            os.unlink(self.mark)
            os.kill(os.getpid(), signal.SIGKILL)
        return self.records[i]


class BadImages(torch.utils.data.Dataset):
    """``Records(n, "dict")`` whose ``__getitem__`` raises ``OSError`` for the indices in ``bad``."""

    def __init__(self, n: int, bad):
        self.records, self.bad = Records(n, "dict"), frozenset(bad)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        if i in self.bad:
            raise OSError(f"cannot decode image {i}")
        return self.records[i]


class FetchedInBatches(torch.utils.data.Dataset):
    """Records fetched only a batch at a time (``__getitem__`` refuses), as datasets that read a
    batch in one call do: each sample says how many indices its call was given."""

    def __len__(self) -> int:
        return 11

    def __getitem__(self, i: int):
        raise NotImplementedError("fetched by __getitems__ only")

    def __getitems__(self, indices):
        if 7 in indices and getattr(self, "fails_at_7", False):
            raise KeyError(7)
        if getattr(self, "collated", False):  # the batch made whole, for a collate_fn that takes it
            return {"label": torch.tensor(indices)}
        return [{"image": torch.full((2, 2), float(i)), "label": i, "call": len(indices)} for i in indices]


class NoBatchFetch(Records):
    """Records whose ``__getitems__`` is None: a DataLoader fetches them one by one."""

    __getitems__ = None
