"""from_dataset behaves as torch.utils.data.DataLoader where a user would notice the difference."""

from __future__ import annotations

import collections
import os
import signal
import sys
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from extsrc.torch import from_dataset

from sample_datasets import Records, ShardedStream, collated_alone, shard_by_worker_init

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from faultkit import run_isolated  # noqa: E402


def test_workers_run_torch_ops_after_the_parent_used_intra_op_threads():
    # GNU OpenMP's thread pool does not survive fork: a forked child that runs a parallel op
    # waits forever for threads it does not have, unless it uses one thread, as DataLoader's
    # workers do.
    done = run_isolated("""
        import torch
        from extsrc.torch import from_dataset

        class Convolved(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                image = torch.full((1, 3, 64, 64), float(i))
                return torch.nn.functional.conv2d(image, torch.ones(4, 3, 3, 3))[0]

        torch.set_num_threads(2)
        x = torch.randn(1, 3, 256, 256)
        torch.nn.functional.conv2d(x, torch.randn(8, 3, 5, 5))  # the parent's threads start
        with from_dataset(Convolved(), batch_size=4, num_workers=2) as loader:
            sums = [batch.sum().item() for batch in loader]
        print("OK", len(sums))
    """, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "OK 2" in done.stdout


def test_workers_that_wait_for_each_other_in_getitem_do_not_deadlock():
    # Every worker's first __getitem__ waits until all workers have called it: the loader must
    # neither call __getitem__ itself nor give the workers their first samples one at a time.
    done = run_isolated("""
        import multiprocessing, torch
        from extsrc.torch import from_dataset

        class Synchronised(torch.utils.data.Dataset):
            def __init__(self, parties):
                self.barrier = multiprocessing.get_context("fork").Barrier(parties)
                self.waited = False
            def __len__(self):
                return 12
            def __getitem__(self, i):
                if not self.waited:
                    self.barrier.wait()
                    self.waited = True
                return i

        with from_dataset(Synchronised(3), batch_size=1, num_workers=3) as loader:
            print("OK", sorted(int(b) for b in loader))
    """, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"OK {list(range(12))}" in done.stdout


class _Fails(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        raise FileNotFoundError(f"/data/{i}.jpg")


def test_an_error_in_getitem_is_raised_at_iteration_not_construction():
    loader = from_dataset(_Fails(), batch_size=2, num_workers=1)  # as a DataLoader: no error yet
    with loader:
        with pytest.raises(FileNotFoundError, match=r"/data/0\.jpg"):
            next(iter(loader))


class _Growing(torch.utils.data.Dataset):
    def __init__(self):
        self.n = 10

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def test_the_dataloader_attributes_are_there_and_read_only():
    dataset = _Growing()
    init = print
    with from_dataset(dataset, batch_size=3, drop_last=True, num_workers=2, timeout=20,
                      worker_init_fn=init, prefetch_factor=4) as loader:
        theirs = DataLoader(dataset, batch_size=3, drop_last=True)
        assert loader.dataset is dataset and loader.batch_size == 3 and loader.drop_last is True
        assert loader.num_workers == 2 and loader.timeout == 20 and loader.worker_init_fn is init
        assert loader.prefetch_factor == 4 and loader.pin_memory is False
        assert loader.collate_fn is theirs.collate_fn and loader.generator is None
        assert type(loader.sampler) is type(theirs.sampler)
        assert list(loader.batch_sampler) == list(theirs.batch_sampler)
        for name in ("dataset", "batch_size", "drop_last", "sampler", "batch_sampler", "num_workers",
                     "collate_fn", "pin_memory", "timeout", "worker_init_fn", "prefetch_factor",
                     "persistent_workers", "generator", "in_order", "multiprocessing_context"):
            with pytest.raises(ValueError, match=f"{name} attribute should not be set"):
                setattr(loader, name, getattr(loader, name))
            with pytest.raises(ValueError):
                theirs.batch_size = 4  # what a DataLoader does


def test_len_follows_the_dataset_as_a_dataloaders_does():
    dataset = _Growing()
    with from_dataset(dataset, batch_size=3, num_workers=1) as loader:
        theirs = DataLoader(dataset, batch_size=3)
        assert len(loader) == len(theirs) == 4
        dataset.n = 16
        assert len(loader) == len(theirs) == 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for machines without CUDA")
def test_pin_memory_without_cuda_warns_and_gives_the_batches():
    with pytest.warns(UserWarning, match="pin_memory=True"):
        loader = from_dataset(_Growing(), batch_size=5, num_workers=1, pin_memory=True)
    with loader:
        assert loader.pin_memory is True
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


class _Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        time.sleep(60)
        return i


def test_a_timeout_raises_a_runtime_error_as_a_dataloaders():
    # With the phrase DataLoader's error starts with, then what was stuck.
    with from_dataset(_Slow(), batch_size=2, num_workers=1, timeout=1) as loader:
        with pytest.raises(RuntimeError, match=r"^DataLoader timed out after 1 seconds\. .*timeout=1") as raised:
            next(iter(loader))
    assert raised.value.timeout == 1


class _Crashes(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        os.kill(os.getpid(), signal.SIGSEGV)


class _CrashingStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        os.kill(os.getpid(), signal.SIGSEGV)
        yield 0


@pytest.mark.parametrize("dataset", [_Crashes, _CrashingStream])
def test_a_worker_killed_by_a_signal_is_told_as_a_dataloader_tells_it(dataset):
    # A RuntimeError with the phrase DataLoader's has (code matches it), then extsrc's account;
    # the loop ends with its worker (map-style or iterable alike): it neither hangs nor raises again.
    with from_dataset(dataset(), batch_size=2, num_workers=1) as loader:
        loop = iter(loader)
        with pytest.raises(RuntimeError, match=r"^DataLoader worker \(pid \d+\) is killed by signal: "
                                               r"Segmentation fault\. extsrc worker 0 .*SIGSEGV") as raised:
            next(loop)
        assert next(loop, "ended") == "ended"
    assert raised.value.signal == signal.SIGSEGV and raised.value.pid > 0


def test_more_workers_than_cpus_warn():
    cpus = len(os.sched_getaffinity(0))
    # With the phrase DataLoader's warning has, which code written for it matches.
    with pytest.warns(UserWarning, match=f"{cpus + 1} worker processes.*excessive worker creation "
                                         "might get DataLoader running slow or even freeze"):
        loader = from_dataset(_Growing(), batch_size=5, num_workers=cpus + 1)
    loader.close()


class _WorkerInfos(torch.utils.data.Dataset):
    def __init__(self):
        self.started = None

    def __len__(self):
        return 16

    def __getitem__(self, i):
        info = get_worker_info()
        return {"id": info.id, "num_workers": info.num_workers, "seed": info.seed,
                "same_dataset": info.dataset is self, "started": self.started,
                "torch_seed": torch.initial_seed()}


def _mark_started(worker_id):
    get_worker_info().dataset.started = 100 + worker_id


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_worker_init_fn_and_get_worker_info_run_in_each_worker(start_method):
    with from_dataset(_WorkerInfos(), batch_size=2, num_workers=2, worker_init_fn=_mark_started,
                      multiprocessing_context=start_method) as loader:
        batches = list(loader)
    rows = [dict(zip(b, values)) for b in batches for values in zip(*(b[k].tolist() for k in b))]
    assert {r["id"] for r in rows} == {0, 1}
    for row in rows:
        assert row["num_workers"] == 2 and row["same_dataset"] and row["started"] == 100 + row["id"]
        assert row["torch_seed"] == row["seed"]  # as a DataLoader's workers: seeded with info.seed
    seeds = {r["id"]: r["seed"] for r in rows}
    assert seeds[1] == seeds[0] + 1  # base seed + worker id
    assert get_worker_info() is None  # not in this process


class _Nested(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"path": f"/data/{i}.jpg", "meta": {"size": (i, 2 * i), "scale": i / 4,
                                                      "crop": {"box": np.arange(4) + i}},
                "image": torch.full((2, 2), i), "tags": [f"t{i}", b"raw"]}


def test_nested_dicts_and_strings_are_collated_as_a_dataloader_collates_them():
    theirs = list(DataLoader(_Nested(), batch_size=4))
    with from_dataset(_Nested(), batch_size=4, num_workers=2) as loader:
        ours = list(loader)
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        _same(a, b)


def _same(ours, theirs, where=""):
    assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} vs {type(theirs).__name__}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        for key in theirs:
            _same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for k, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"{where}[{k}]")
    else:
        assert ours == theirs, where


class _Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.arange(4096, dtype=torch.float32) + i, i


def _padded(samples):
    """A collate_fn of the kind users write: stacked tensors, a count, names, an object."""
    return {"x": torch.stack([s[0] for s in samples]), "count": len(samples),
            "names": [f"#{s[1]}" for s in samples], "extra": None,
            "ids": tuple(torch.tensor(s[1]) for s in samples)}


def _ids(samples):
    return [s["i"] for s in samples]


def _in_shared_memory(tensor):
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "extsrc:" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                if start <= tensor.data_ptr() < end:
                    return True
    return False


@pytest.mark.parametrize("kwargs", [
    dict(batch_size=3, collate_fn=_padded),
    dict(batch_size=4, collate_fn=_padded, drop_last=True),
    dict(batch_size=3, collate_fn=lambda samples: samples),  # the last batch has fewer leaves
    dict(batch_size=None),
    dict(batch_size=None, collate_fn=lambda sample: sample[1] * 2),
])
def test_collate_fn_and_batch_size_none_give_a_dataloaders_batches(kwargs):
    theirs = list(DataLoader(_Pairs(), **kwargs))
    with from_dataset(_Pairs(), num_workers=2, **kwargs) as loader:
        assert len(loader) == len(theirs)
        ours = list(loader)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        _same(a, b)


def test_tensors_a_collate_fn_returns_come_through_shared_memory():
    with from_dataset(_Pairs(), batch_size=3, collate_fn=_padded, num_workers=2) as loader:
        batches = list(loader)
        assert all(_in_shared_memory(b["x"]) for b in batches)  # not pickled: views of the batch
        assert [b["x"][:, 0].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


class _CountsCalls(torch.utils.data.Dataset):
    def __init__(self):
        self.pids = set()

    def __len__(self):
        return 7

    def __getitem__(self, i):
        self.pids.add(os.getpid())
        return {"x": np.full((2,), i), "name": f"n{i}"}


@pytest.mark.parametrize("num_workers", [-1, 1.5, True, "2"])
def test_a_negative_or_non_int_num_workers_is_refused_saying_0_is_allowed(num_workers):
    # As DataLoader refuses it; the message said "a positive int" though 0 is valid.
    with pytest.raises(ValueError, match=f"should be non-negative.*num_workers={num_workers!r}"):
        from_dataset(_CountsCalls(), num_workers=num_workers)


@pytest.mark.parametrize("kwargs", [dict(batch_size=3), dict(batch_size=3, drop_last=True),
                                    dict(batch_size=None), dict(batch_size=2, collate_fn=len)])
def test_num_workers_0_loads_in_this_process_as_a_dataloader(kwargs):
    dataset = _CountsCalls()
    theirs = list(DataLoader(dataset, num_workers=0, **kwargs))
    dataset.pids.clear()
    with from_dataset(dataset, num_workers=0, **kwargs) as loader:
        assert len(loader) == len(theirs) and loader.num_workers == 0
        for _ in range(2):
            ours = list(loader)
            assert len(ours) == len(theirs)
            for a, b in zip(ours, theirs):
                _same(a, b)
    assert dataset.pids == {os.getpid()}  # here, for a debugger to stop in
    with pytest.raises(ValueError, match="prefetch_factor"):
        from_dataset(dataset, num_workers=0, prefetch_factor=2)


@pytest.mark.parametrize("kwargs", [
    dict(batch_size=4, num_workers=2),
    dict(batch_size=4, num_workers=2, drop_last=True),
    dict(batch_size=None, num_workers=2),
    dict(batch_size=5, num_workers=2, collate_fn=_ids),
    dict(batch_size=3, num_workers=0),
])
def test_an_iterable_dataset_gives_a_dataloaders_batches_in_its_order(kwargs):
    theirs = list(DataLoader(ShardedStream(23), **kwargs))
    with from_dataset(ShardedStream(23), **kwargs) as loader:
        assert len(loader) == len(DataLoader(ShardedStream(23), **kwargs))
        for _ in range(2):  # each loop is a new pass of every worker
            ours = list(loader)
            assert len(ours) == len(theirs)
            for a, b in zip(ours, theirs):
                _same(a, b)


class _FileNames(torch.utils.data.Dataset):
    """A path and a label: the path not UTF-8 (os.listdir() gives such names lone surrogates)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {"path": os.fsdecode(b"img-\xff-%d.jpg" % i), "label": i}


def _paths(samples):
    return [sample["path"] for sample in samples]


@pytest.mark.parametrize("kwargs", [dict(num_workers=2), dict(num_workers=2, collate_fn=_paths),
                                    dict(num_workers=0)], ids=["default", "collate_fn", "no-workers"])
def test_file_names_that_are_not_utf8_come_back_as_the_dataset_gave_them(kwargs):
    theirs = list(DataLoader(_FileNames(), batch_size=4, **kwargs))
    with from_dataset(_FileNames(), batch_size=4, **kwargs) as loader:
        ours = list(loader)
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        _same(a, b)
    assert os.fsencode((ours[0]["path"] if "collate_fn" not in kwargs else ours[0])[0]) == b"img-\xff-0.jpg"


def _numpy_and_tensors(samples):
    """A batch of NumPy arrays and a scalar beside a tensor and a number (e.g. for a JAX step)."""
    return {"paths": _paths(samples), "labels": np.array([s["label"] for s in samples], np.int32),
            "scale": np.float32(0.5), "ids": torch.tensor([s["label"] for s in samples]), "count": len(samples),
            "seed": 2**64 - 1 - samples[0]["label"]}  # a Python int past int64


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_collate_fns_numpy_arrays_and_python_ints_come_back_as_it_made_them(num_workers):
    kwargs = dict(batch_size=4, num_workers=num_workers, collate_fn=_numpy_and_tensors)
    theirs = list(DataLoader(_FileNames(), **kwargs))
    with from_dataset(_FileNames(), **kwargs) as loader:
        for _ in range(2):
            ours = list(loader)
            assert len(ours) == len(theirs) == 3
            for a, b in zip(ours, theirs):
                assert {k: type(v) for k, v in a.items()} == {k: type(v) for k, v in b.items()}
                assert a["labels"].dtype == np.int32 and a["labels"].tolist() == b["labels"].tolist()
                assert a["scale"] == b["scale"] and torch.equal(a["ids"], b["ids"])
                assert a["paths"] == b["paths"] and a["count"] == b["count"] and a["seed"] == b["seed"]


class _ChangingFields(torch.utils.data.IterableDataset):
    """Batches of 2 whose fields change from batch to batch: a list that grows, then a task's keys."""

    def __iter__(self):
        for i in range(8):
            yield {"ids": list(range(i // 2 + 1)), "label": i} if i < 4 else {"text": "abc", "label": i}


def test_an_iterable_dataset_whose_fields_change_is_refused_saying_what_to_give():
    with from_dataset(_ChangingFields(), batch_size=2, num_workers=1) as loader:
        batches = iter(loader)
        next(batches)
        with pytest.raises(TypeError, match=r"batch 1 of this worker has another structure than the "
                                            r"worker's first batch .*collate_fn=lambda samples: default_collate"):
            next(batches)
    kwargs = dict(batch_size=2, num_workers=1, collate_fn=collated_alone)
    theirs = list(DataLoader(_ChangingFields(), **kwargs))
    with from_dataset(_ChangingFields(), **kwargs) as loader:
        ours = list(loader)
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        _same(a, b)


class _OneOddBatchPerWorker(torch.utils.data.IterableDataset):
    """Each of 2 workers yields 8 records (every other one), in batches of 2; each worker's
    batch 1 has a field more, or fails in collate_fn (``failing``)."""

    def __init__(self, failing=False):
        self.failing = failing

    def __iter__(self):
        worker = get_worker_info().id
        for k, i in enumerate(range(worker, 16, 2)):
            odd = k // 2 == 1
            yield {"id": i, "fail": odd} if self.failing or not odd else {"id": i, "extra": 0}


def _collate_unless_told(samples):
    if any(sample["fail"] for sample in samples):
        raise ValueError(f"cannot collate {[sample['id'] for sample in samples]}")
    return torch.utils.data.default_collate(samples)


def _loop_through_errors(loader):
    """Each batch's ids, or the type of the error raised in its place, until the loop ends."""
    got, batches = [], iter(loader)
    while True:
        try:
            got.append(next(batches)["id"].tolist())
        except StopIteration:
            return got
        except (TypeError, ValueError) as error:
            got.append(type(error).__name__)


@pytest.mark.parametrize("failing", [False, True], ids=["fields-change", "collate-fn-raises"])
def test_an_iterable_datasets_batch_that_fails_loses_none_of_the_workers_later_batches(failing):
    # Each worker's batch 1 fails in its place; batches 2 and 3 of both still come, in the
    # DataLoader's turn (worker 0, worker 1, worker 0, ...), as they do from a DataLoader.
    error = "ValueError" if failing else "TypeError"
    expected = [[0, 2], [1, 3], error, error, [8, 10], [9, 11], [12, 14], [13, 15]]
    kwargs = dict(batch_size=2, num_workers=2, **({"collate_fn": _collate_unless_told} if failing else {}))
    if failing:  # the DataLoader refuses nothing for a field more: it keeps the first sample's
        assert _loop_through_errors(DataLoader(_OneOddBatchPerWorker(failing), **kwargs)) == expected
    with from_dataset(_OneOddBatchPerWorker(failing), **kwargs) as loader:
        for _ in range(2):
            assert _loop_through_errors(loader) == expected


def test_an_iterable_dataset_sharded_by_worker_init_fn_in_spawned_workers():
    with from_dataset(ShardedStream(10), batch_size=2, num_workers=2, multiprocessing_context="spawn",
                      worker_init_fn=shard_by_worker_init) as loader:
        ids = [i for batch in loader for i in batch["i"].tolist()]
    assert sorted(ids) == list(range(10))  # each record once: the workers' copies were sharded


class _FailsOnOdd(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i % 4 == 2:
            raise KeyError(i)
        return i


def test_in_process_an_error_is_raised_at_its_batch_and_the_loop_goes_on():
    with from_dataset(_FailsOnOdd(), batch_size=2, num_workers=0) as loader:
        it, got = iter(loader), []
        for _ in range(len(loader)):
            try:
                got.append(next(it).tolist())
            except KeyError as exc:
                got.append(f"KeyError {exc}")
        assert got == [[0, 1], "KeyError 2", [4, 5], "KeyError 6"]
        with pytest.raises(StopIteration):
            next(it)


def test_a_generator_decides_the_shuffled_order_and_the_seeds():
    def epochs(seed):
        with from_dataset(_Growing(), batch_size=5, shuffle=True, num_workers=0,
                          generator=torch.Generator().manual_seed(seed)) as loader:
            assert loader.generator is not None
            return [torch.cat(list(loader)).tolist() for _ in range(2)]
    first = epochs(42)
    assert first == epochs(42) and first != epochs(7)
    assert sorted(first[0]) == list(range(10)) and first[0] != first[1]


def test_a_datapipe_is_shuffled_and_sharded_as_a_dataloader_does():
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(20)).shuffle().sharding_filter()
    with from_dataset(pipe, batch_size=None, shuffle=True, num_workers=2) as loader:
        values = list(loader)
    assert sorted(values) == list(range(20)) and values != list(range(20))


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_datapipe_s_shuffle_follows_torch_manual_seed_at_each_loop_as_in_a_dataloader(num_workers):
    # DataLoader draws a datapipe's shuffle seed at each iter(): the same torch.manual_seed()
    # before two loops gives the same order, another seed another order. The workers' seed
    # was drawn once, when the loader was made, and every loop's order ignored manual_seed().
    from torch.utils.data.datapipes.iter import IterableWrapper

    def orders(make):
        torch.manual_seed(999)
        pipe = IterableWrapper(range(100)).shuffle(buffer_size=5).sharding_filter()
        loader = make(pipe, num_workers=num_workers, shuffle=True, multiprocessing_context="fork")
        try:
            found = []
            for seed in (123, 123, 321):
                torch.manual_seed(seed)
                found.append([int(x) for x in loader])
            return found
        finally:
            if hasattr(loader, "close"):
                loader.close()

    ours = orders(from_dataset)
    assert ours[0] == ours[1] and ours[0] != ours[2]
    assert sorted(ours[2]) == list(range(100))
    assert ours == orders(DataLoader)


def _refuses(worker_id):
    raise RuntimeError(f"no setup in worker {worker_id}")


def test_an_error_in_worker_init_fn_is_raised_at_iteration_as_a_runtime_error():
    with from_dataset(_Growing(), batch_size=2, num_workers=2, worker_init_fn=_refuses) as loader:
        with pytest.raises(RuntimeError, match="no setup in worker"):
            list(loader)


class _HoldsItsRecordType(torch.utils.data.Dataset):
    Pair = collections.namedtuple("Pair", ["value", "name"])  # pickle cannot find it by name

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.Pair(i, str(i))


_Renamed = collections.namedtuple("Record", ["value", "name"])  # held under another name


class _RenamedRecords(_HoldsItsRecordType):
    def __getitem__(self, i):
        return _Renamed(i, str(i))


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("dataset, record_type", [(_HoldsItsRecordType(), _HoldsItsRecordType.Pair),
                                                   (_RenamedRecords(), _Renamed)])
@pytest.mark.parametrize("batch_size", [2, None])
def test_a_namedtuple_class_pickle_cannot_find_by_name_comes_back_as_that_class(
        method, dataset, record_type, batch_size):
    # As a DataLoader in the main process gives them: isinstance() and match statements on the
    # user's own class keep working.
    with from_dataset(dataset, batch_size=batch_size, num_workers=1,
                      multiprocessing_context=method) as loader:
        batches = list(loader)
    assert all(type(b) is record_type for b in batches)
    if batch_size == 2:
        assert [b.value.tolist() for b in batches] == [[0, 1], [2, 3]]
        assert [b.name for b in batches] == [("0", "1"), ("2", "3")]  # as default_collate gives
    else:
        assert [(int(b.value), b.name) for b in batches] == [(i, str(i)) for i in range(4)]


def _both(dataset, epochs=1, **kwargs):
    """The batches of ``epochs`` loops of from_dataset and of a DataLoader, given ``kwargs``."""
    ours, theirs = [], []
    with from_dataset(dataset, **kwargs) as loader:
        for _ in range(epochs):
            ours.append([_as_lists(batch) for batch in loader])
    reference = DataLoader(dataset, **kwargs)
    for _ in range(epochs):
        theirs.append([_as_lists(batch) for batch in reference])
    return ours, theirs


def _as_lists(batch):
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [_as_lists(part) for part in batch]
    return batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_decides_the_indices_of_each_batch(num_workers):
    # A plain iterable of indices, in an order no shuffle would give, and fewer than the records.
    ours, theirs = _both(Records(20), epochs=2, sampler=[7, 3, 3, 19, 0, 11, 5], batch_size=3,
                         num_workers=num_workers)
    assert ours == theirs
    assert [b[1] for b in ours[0]] == [[7, 3, 3], [19, 0, 11], [5]]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_batch_sampler_gives_batches_of_its_own_sizes(start_method):
    batches = [(0, 1), (2, 3, 4), (9,), (5, 6, 7, 8)]
    with from_dataset(Records(10), batch_sampler=batches, num_workers=2,
                      multiprocessing_context=start_method) as loader:
        assert len(loader) == 4 and loader.batch_size is None and loader.batch_sampler is batches
        labels = [batch[1].tolist() for batch in loader]
    assert labels == [list(b) for b in batches]


def test_a_random_sampler_with_replacement_sets_len_and_the_batches():
    sampler = torch.utils.data.RandomSampler(Records(10), replacement=True, num_samples=15,
                                             generator=torch.Generator().manual_seed(5))
    with from_dataset(Records(10), batch_size=4, sampler=sampler, num_workers=2) as loader:
        assert len(loader) == 4  # 15 samples in batches of 4, as a DataLoader counts them
        sizes = [len(batch[1]) for batch in loader]
    assert sizes == [4, 4, 4, 3]


def test_distributed_samplers_with_drop_last_cover_each_record_once():
    from torch.utils.data.distributed import DistributedSampler

    seen = []
    for rank in range(4):
        sampler = DistributedSampler(Records(9), num_replicas=4, rank=rank, shuffle=False)
        with from_dataset(Records(9), batch_size=2, drop_last=True, sampler=sampler,
                          num_workers=2) as loader:
            seen += [label for batch in loader for label in batch[1].tolist()]
    assert sorted(seen) == list(range(8))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("persistent_workers", [False, True])
def test_shuffle_with_a_generator_gives_a_dataloaders_order_every_epoch(num_workers, persistent_workers):
    if num_workers == 0 and persistent_workers:
        pytest.skip("persistent_workers needs workers")
    ours, theirs = [], []
    for make, out in ((from_dataset, ours), (DataLoader, theirs)):
        loader = make(Records(23), batch_size=4, shuffle=True, num_workers=num_workers,
                      persistent_workers=persistent_workers,
                      generator=torch.Generator().manual_seed(11))
        out += [[batch[1].tolist() for batch in loader] for _ in range(3)]
        if hasattr(loader, "close"):
            loader.close()
    assert ours == theirs and ours[0] != ours[1]


class _StartChecked(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        assert self.start == 0, "the workers have the dataset as it was when the loop began"
        return i


def test_workers_start_at_the_first_loop_and_see_the_dataset_as_it_was_then():
    dataset = _StartChecked()  # no `start` yet: a worker started now would fail
    with from_dataset(dataset, batch_size=2, num_workers=2, persistent_workers=True) as loader:
        assert loader.source.worker_pids() == []
        dataset.start = 0
        for epoch in range(3):
            assert torch.cat(list(loader)).tolist() == list(range(6))
            dataset.start = epoch + 1  # persistent workers keep the copy they started with


class _FailsEveryFifth(torch.utils.data.Dataset):
    def __len__(self):
        return 23

    def __getitem__(self, i):
        if i % 5 == 2:
            raise NotImplementedError(f"record {i}")
        return i


@pytest.mark.parametrize("kwargs", [dict(), dict(shuffle=True), dict(sampler=list(range(23))[::-1])])
def test_an_error_in_a_worker_fails_its_batch_and_the_loop_goes_on(kwargs):
    # As a DataLoader's: each failing batch raises, the others come, the epoch ends after the
    # last batch, and the next epoch runs on the same workers.
    with from_dataset(_FailsEveryFifth(), batch_size=3, num_workers=2, **kwargs) as loader:
        for _ in range(2):
            it, labels, errors = iter(loader), [], 0
            while True:
                try:
                    labels += next(it).tolist()
                except NotImplementedError:
                    errors += 1
                except StopIteration:
                    break
            assert errors + len(labels) // 3 + (len(labels) % 3 > 0) == 8  # ceil(23 / 3) batches
            assert errors > 0 and all(label % 5 != 2 for label in labels)
            assert len(set(labels)) == len(labels)


def test_in_process_state_dict_resumes_at_the_next_batch_of_the_epoch():
    def loader():
        return from_dataset(Records(14), batch_size=3, shuffle=True, seed=4, num_workers=0)

    first = loader()
    list(first)  # epoch 0
    it = iter(first)
    taken = [next(it)[1].tolist() for _ in range(2)]
    state = first.state_dict()
    rest = [batch[1].tolist() for batch in it]
    again = loader()
    again.load_state_dict(state)
    assert [batch[1].tolist() for batch in again] == rest
    assert len(taken) + len(rest) == 5


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_after_the_last_batch_resumes_at_the_end_of_that_epoch(num_workers):
    # Saved inside the loop after its last batch, the state is that epoch's end (resuming it
    # gives no batch, then the next epoch); saved once the loop ended, the next epoch's start.
    # In this process as with workers (in this process it pointed at the next epoch at once).
    def loader():
        return from_dataset(Records(10), batch_size=4, num_workers=num_workers)

    with loader() as first:
        for _ in first:
            inside = first.state_dict()
        after = first.state_dict()
    assert (inside["epoch_idx"], inside["iteration"]) == (0, 3)
    assert (after["epoch_idx"], after["iteration"]) == (1, 0)
    for state, batches in ((inside, 0), (after, 3)):
        with loader() as resumed:
            resumed.load_state_dict(state)
            assert len(list(resumed)) == batches
            assert len(list(resumed)) == 3  # then a whole epoch


def test_state_dict_is_refused_with_a_sampler_rather_than_resuming_elsewhere():
    with from_dataset(Records(8), batch_size=2, sampler=[3, 1, 2], num_workers=1) as loader:
        with pytest.raises(TypeError, match="cannot be drawn again"):
            loader.state_dict()


def test_a_failing_worker_init_fn_is_the_error_raised_not_a_later_one():
    # The loop must not try to go on past a setup failure (the workers are gone): the error
    # raised is the worker_init_fn's, not one from a retry on the shut-down workers.
    from extsrc.errors import PoolClosedError, WorkerDiedError

    for _ in range(3):
        with from_dataset(_Growing(), batch_size=2, num_workers=2, worker_init_fn=_refuses) as loader:
            with pytest.raises(RuntimeError, match="no setup in worker") as raised:
                list(loader)
            assert not isinstance(raised.value, (PoolClosedError, WorkerDiedError))


def test_keeping_every_batch_does_not_use_up_descriptors():
    # A DataLoader sharing tensors by descriptor runs out of them when the consumer keeps every
    # batch (PyTorch's test_fd_limit_exceeded accepts that, with advice); kept batches hold
    # memory here, not descriptors, so all of them come under a limit of 100.
    out = run_isolated(
        """
        import resource
        import torch
        from torch.utils.data import IterableDataset
        from extsrc.torch import from_dataset

        class Stream(IterableDataset):
            def __iter__(self):
                for i in range(2000):
                    yield torch.full((4,), i)

        if __name__ == "__main__":
            resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            kept = []
            with from_dataset(Stream(), batch_size=1, num_workers=1) as loader:
                for batch in loader:
                    kept.append(batch)
            intact = all(torch.equal(b, torch.full((1, 4), i)) for i, b in enumerate(kept))
            print("ALL", len(kept), intact)
        """,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "ALL 2000 True" in out.stdout, out.stdout + out.stderr[-2000:]


# What code written for DataLoader matches in its errors (PyTorch's own tests among it): each
# message keeps that phrase and says the rest in extsrc's words.
@pytest.mark.parametrize("kwargs, error, phrase", [
    ({"num_workers": 0, "multiprocessing_context": "fork"}, ValueError,
     r"multi-process loading \(num_workers > 0\), but got"),
    ({"num_workers": 2, "multiprocessing_context": object()}, TypeError,
     "multiprocessing_context option should be a valid context "),
    ({"num_workers": 2, "multiprocessing_context": "teleport"}, ValueError,
     "should specify a valid start method in"),
    ({"timeout": -1}, ValueError, "timeout option should be non-negative"),
])
def test_a_bad_option_is_refused_as_dataloader_refuses_it(kwargs, error, phrase):
    with pytest.raises(error, match=phrase):
        DataLoader(_Growing(), **kwargs)
    with pytest.raises(error, match=phrase):
        from_dataset(_Growing(), **kwargs)


def test_a_multiprocessing_context_object_chooses_the_start_method():
    import multiprocessing

    with from_dataset(_Growing(), batch_size=4, num_workers=1,
                      multiprocessing_context=multiprocessing.get_context("spawn")) as loader:
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_concurrency_without_workers_is_refused_rather_than_ignored():
    with pytest.raises(ValueError, match="concurrency=4 needs .* num_workers=0"):
        from_dataset(_Growing(), batch_size=2, num_workers=0, concurrency=4)


def test_from_dataset_in_place_of_dataloader_in_type_annotations():
    # Code typed with DataLoader[...] keeps working when only the import changes.
    from typing import List

    from extsrc.torch import from_dataset as Loader

    def loader_of(dataset) -> Loader[List[torch.Tensor]]:
        return Loader(dataset, batch_size=5, num_workers=1)

    with loader_of(_Growing()) as loader:
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert Loader[int] is Loader and Loader.__name__ == "from_dataset"


class _Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return os.getpid()


def test_without_num_workers_the_dataset_is_loaded_in_this_process_as_a_dataloaders():
    theirs = DataLoader(_Pids(), batch_size=2)
    with from_dataset(_Pids(), batch_size=2) as loader:
        assert loader.num_workers == theirs.num_workers == 0
        assert [b.tolist() for b in loader] == [b.tolist() for b in theirs] == [[os.getpid()] * 2] * 2


class _Unsharded(torch.utils.data.IterableDataset):
    """Every worker yields the whole dataset: the mistake a DataLoader warns about."""

    def __len__(self):
        return 6

    def __iter__(self):
        return iter(range(6))


def test_an_iterable_dataset_yielding_more_than_its_len_warns_once_len_was_asked_as_a_dataloaders():
    for loader in (from_dataset(_Unsharded(), batch_size=None, num_workers=2),
                   DataLoader(_Unsharded(), batch_size=None, num_workers=2)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert sum(1 for _ in loader) == 12  # len() not asked (list() would): no warning
        assert len(loader) == 6
        with pytest.warns(UserWarning, match=r"was reported to be 6.*but 7 samples have been "
                                             r"fetched\. For multiprocessing data-loading"):
            assert sum(1 for _ in loader) == 12
        getattr(loader, "close", lambda: None)()


def test_a_sharded_iterable_dataset_gives_no_length_warning():
    # 23 records over 2 workers in batches of 5: 3 + 3 batches (each worker's last one short)
    # where len() says 5, as with a DataLoader, which gives no warning either.
    for loader in (from_dataset(ShardedStream(23), batch_size=5, num_workers=2),
                   DataLoader(ShardedStream(23), batch_size=5, num_workers=2)):
        assert len(loader) == 5
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(list(loader)) == 6
        getattr(loader, "close", lambda: None)()
