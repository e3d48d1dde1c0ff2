"""Data order: shuffling, shards, equal epochs, per-record randomness, exact resume."""

import json
import pickle
import sys

import numpy as np
import pytest

from extsrc import EmptyEpochError, Order, ParallelSource, SampleInfo
from extsrc.order import RecordCache

from sources import records_and_draws


# -- the order itself --------------------------------------------------------------------------


@pytest.mark.parametrize("n", list(range(1, 70)) + [255, 256, 257, 1000, 4097])
def test_shuffling_is_a_permutation_of_every_record(n):
    order = Order(n, shuffle=True, seed=n)
    for epoch in (0, 1):
        records = list(order.epoch(epoch))
        assert sorted(records) == list(range(n))
        assert records == order.records(epoch, np.arange(n)).tolist()  # scalar and vector agree


def test_shuffling_ten_to_the_twelve_records_is_fast_and_stays_in_range_without_repeats():
    n = 10 ** 12
    order = Order(n, shuffle=True, seed=1)
    positions = np.random.default_rng(0).choice(n, 100_000, replace=False)
    records = order.records(3, positions)
    assert records.min() >= 0 and records.max() < n
    assert len(np.unique(records)) == len(positions)  # a bijection maps distinct to distinct
    assert [order.record(3, int(p)) for p in positions[:100]] == records[:100].tolist()
    assert len(pickle.dumps(order)) < 1000  # O(1) memory: nothing is materialised


def test_every_epoch_has_its_own_order_and_a_seed_gives_the_same_orders():
    a, b, other = (Order(1000, shuffle=True, seed=s) for s in (5, 5, 6))
    epochs = [list(a.epoch(e)) for e in range(3)]
    assert len({tuple(e) for e in epochs}) == 3
    assert epochs == [list(b.epoch(e)) for e in range(3)]
    assert list(other.epoch(0)) != epochs[0]
    assert list(Order(1000).epoch(0)) == list(range(1000))  # no shuffle: the identity


@pytest.mark.parametrize("n, count", [(100, 4), (103, 4), (10, 3), (7, 7), (1001, 8)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_drop_gives_disjoint_equal_shards_of_all_but_the_remainder(n, count, shuffle):
    shards = [list(Order(n, shuffle=shuffle, seed=2, shard=(i, count), remainder="drop").epoch(4))
              for i in range(count)]
    assert {len(s) for s in shards} == {n // count}
    union = [r for s in shards for r in s]
    assert len(set(union)) == len(union) == n // count * count  # disjoint
    assert set(union) <= set(range(n))


@pytest.mark.parametrize("n, count", [(100, 4), (103, 4), (10, 3), (5, 8)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_pad_gives_every_shard_the_same_count_and_every_record_at_least_once(n, count, shuffle):
    shards = [list(Order(n, shuffle=shuffle, seed=2, shard=(i, count), remainder="pad").epoch(1))
              for i in range(count)]
    assert {len(s) for s in shards} == {-(-n // count)}
    assert set(r for s in shards for r in s) == set(range(n))


def test_the_dropped_records_differ_between_epochs_when_shuffling():
    order = Order(103, shuffle=True, seed=1, shard=(0, 4))
    dropped = []
    for epoch in range(3):
        seen = {r for i in range(4) for r in Order(103, shuffle=True, seed=1, shard=(i, 4)).epoch(epoch)}
        dropped.append(set(range(103)) - seen)
    assert len({frozenset(d) for d in dropped}) > 1 and len(order) == 25


def test_an_epoch_is_a_lazy_sequence():
    order = Order(10 ** 12, shuffle=True, seed=3)
    epoch = order.epoch(2)
    assert len(epoch) == 10 ** 12
    tail = epoch[-3:]
    assert len(tail) == 3 and list(tail) == [epoch[10 ** 12 - 3], epoch[10 ** 12 - 2], epoch[10 ** 12 - 1]]
    assert list(epoch[5:20:5]) == [epoch[5], epoch[10], epoch[15]]
    with pytest.raises(IndexError):
        epoch[10 ** 12]


def test_the_record_cache_agrees_with_the_order():
    order = Order(50_000, shuffle=True, seed=9, shard=(1, 3))
    cache = RecordCache(order)
    expected = list(order.epoch(1))
    got = []
    for start in range(0, len(order), 333):
        got += cache.get(1, start, min(start + 333, len(order)))
    assert got == expected


def test_shard_auto_reads_torchruns_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert Order(100, shard="auto").shard == (2, 3)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="RANK=3 is not in range\\(WORLD_SIZE=3\\)"):
        Order(100, shard="auto")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert Order(100, shard="auto").shard == (0, 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_records": 0}, "num_records must be an int in 1..2\\*\\*62"),
    ({"num_records": 10, "shard": (3, 3)}, "shard must be None, 'auto' or \\(index, count\\)"),
    ({"num_records": 10, "remainder": "wrap"}, "remainder must be one of"),
    ({"num_records": 3, "shard": (0, 4)}, "leave each shard no record"),
    ({"num_records": 10, "seed": -1}, "seed must be an int >= 0"),
])
def test_bad_orders_are_refused_with_what_was_expected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Order(**kwargs)


def test_sample_info_keeps_working_without_an_order():
    info = SampleInfo(10, 2, 1, 0)
    assert info.record == 10 and info.seed == 0 and info[:4] == (10, 2, 1, 0)
    assert repr(info) == "SampleInfo(idx_in_epoch=10, idx_in_batch=2, iteration=1, epoch_idx=0)"
    assert pickle.loads(pickle.dumps(info)) == info
    draws = info.rng.random(2)
    assert info.rng.random() not in draws  # one generator per info: the draws go on
    assert SampleInfo(10, 2, 1, 0).rng.random(2).tolist() == draws.tolist()


# -- through the engine ------------------------------------------------------------------------


def epoch_records(src):
    return [int(r) for b in src for r in b.as_array()[:, 0]]


@pytest.mark.parametrize("workers, method", [(1, "fork"), (2, "fork"), (2, "spawn")])
def test_the_callback_gets_the_orders_records_and_draws_whatever_workers_or_start_method(workers, method):
    order = Order(90, shuffle=True, seed=4)
    with ParallelSource(records_and_draws, 8, num_workers=workers, start_method=method, order=order,
                        last_batch="partial") as src:
        assert len(src) == 12
        epochs = [[b.as_array() for b in src] for _ in range(2)]
    for epoch, batches in enumerate(epochs):
        samples = np.concatenate(batches)
        assert samples[:, 0].tolist() == list(order.epoch(epoch))
        expected = [int(np.random.default_rng((4, epoch, r)).integers(1 << 40)) for r in samples[:, 0]]
        assert samples[:, 1].tolist() == expected


def test_shards_see_disjoint_records_the_same_number_of_batches_and_the_same_draws():
    records, batches, draws = [], [], {}
    for index in range(3):
        order = Order(100, shuffle=True, seed=8, shard=(index, 3))
        with ParallelSource(records_and_draws, 8, num_workers=2, order=order) as src:
            got = [b.as_array() for b in src]
        batches.append(len(got))
        samples = np.concatenate(got)
        records += samples[:, 0].tolist()
        draws.update(zip(samples[:, 0].tolist(), samples[:, 1].tolist()))
    assert len(set(records)) == len(records) == 96 and batches == [4, 4, 4]
    with ParallelSource(records_and_draws, 10, num_workers=1, order=Order(100, shuffle=True, seed=8)) as one:
        whole = np.concatenate([b.as_array() for b in one])
    assert all(draws[r] == d for r, d in whole.tolist() if r in draws)  # draws follow the record


@pytest.mark.parametrize("last_batch, sizes", [("drop", [8] * 4), ("partial", [8] * 4 + [2]), ("pad", [8] * 5)])
def test_the_engine_ends_the_epoch_after_the_shards_records(last_batch, sizes):
    order = Order(34, shuffle=True, seed=1)
    with ParallelSource(records_and_draws, 8, num_workers=2, order=order, last_batch=last_batch) as src:
        got = [b.as_array() for b in src]
        assert [len(b) for b in got] == sizes and len(src) == len(sizes)
    records = np.concatenate(got)[:, 0].tolist()
    expected = list(order.epoch(0))
    if last_batch == "pad":
        assert records == expected + expected[:6]  # filled from the start of the order
    else:
        assert records == expected[:len(records)]


def test_resume_mid_epoch_gives_the_same_records_and_draws():
    order = Order(200, shuffle=True, seed=3, shard=(1, 2))
    with ParallelSource(records_and_draws, 8, num_workers=2, order=order) as src:
        it = iter(src)
        for _ in range(5):
            next(it)
        state = json.loads(json.dumps(src.get_state()))
        assert len(json.dumps(state)) < 300
        rest = [b.as_array() for b in it]
    with ParallelSource(records_and_draws, 8, num_workers=1, start_method="spawn", order=order) as again:
        again.set_state(state)
        resumed = [b.as_array() for b in again]
    assert len(rest) == 7 and len(resumed) == 7
    assert all((a == b).all() for a, b in zip(rest, resumed))


def test_a_state_saved_with_another_order_is_refused():
    with ParallelSource(records_and_draws, 8, order=Order(100, seed=1)) as src:
        state = src.get_state()
    with ParallelSource(records_and_draws, 8, order=Order(100, seed=2)) as src:
        with pytest.raises(ValueError, match="saved with the order"):
            src.set_state(state)


def test_order_mistakes_are_refused_at_once():
    with pytest.raises(ValueError, match="needs sample mode"):
        ParallelSource(lambda i: [np.zeros(1)], 4, batch=True, order=Order(10))
    with pytest.raises(ValueError, match="last_batch='pad' .* needs order="):
        ParallelSource(records_and_draws, 4, last_batch="pad")
    with pytest.raises(EmptyEpochError, match="an epoch of 10 records .* no batch of batch_size=16"):
        ParallelSource(records_and_draws, 16, order=Order(10))
    with pytest.raises(TypeError, match="len\\(\\) of a ParallelSource needs order="):
        len(ParallelSource(records_and_draws, 4))


@pytest.mark.slow
def test_shard_auto_under_torchrun_two_ranks_disjoint_equal_and_resumable(tmp_path):
    pytest.importorskip("torch")
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = root / "tutorials" / "13_data_parallel_torchrun.py"
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29517",
         str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=str(root),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in reports] == [2, 2]
    records = [set(r["records"]) for r in reports]
    assert not records[0] & records[1]  # disjoint
    assert reports[0]["batches"] == reports[1]["batches"] > 0  # equal: no rank waits at an all-reduce
    assert all(r["resumed_same"] for r in reports)


def stops_at_40(info):
    if info.record >= 40:
        raise StopIteration
    return np.array([info.record], np.int64)


@pytest.mark.parametrize("shuffle,concurrency", [(False, 1), (True, 1), (True, 4)])
def test_a_callback_ending_the_epoch_before_its_order_is_an_error_not_a_shorter_epoch(shuffle, concurrency):
    from extsrc import EpochLengthError

    with ParallelSource(stops_at_40, 8, num_workers=2, order=Order(100, shuffle=shuffle),
                        concurrency=concurrency) as src:
        assert len(src) == 12
        taken = 0
        with pytest.raises(EpochLengthError) as caught:
            for _ in src:
                taken += 1
    message = str(caught.value)
    assert taken < 12  # no silent stop after 5 batches: the batch with the StopIteration raises
    assert "raised StopIteration at sample SampleInfo(" in message
    assert "Order(100" in message and "an epoch of 100 samples" in message
    assert "len(source) == 12 batches of 8" in message
    record = int(message.split("(record ")[1].split(")")[0])
    assert record >= 40  # the sample named is one the callback refused


def by_position(info):
    return np.array([info.idx_in_epoch], np.int64)  # as DALI's tutorials do: the position


def by_record(info):
    return np.array([info.record, info.idx_in_epoch], np.int64)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_reading_idx_in_epoch_under_a_shuffled_order_is_warned_once(method):
    import warnings

    from extsrc import OrderWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ParallelSource(by_position, 8, num_workers=2, start_method=method,
                            order=Order(64, shuffle=True, seed=3)) as src:
            for _ in range(2):
                batches = [b.as_array().ravel().tolist() for b in src]
    notes = [w for w in caught if issubclass(w.category, OrderWarning)]
    assert batches[0] == list(range(8))  # what the callback loads: unshuffled, hence the warning
    assert 1 <= len(notes) <= 1, [str(w.message) for w in notes]
    message = str(notes[0].message)
    assert "idx_in_epoch" in message and "info.record" in message and "Order(64, shuffle=True" in message


@pytest.mark.parametrize("source, order", [
    (by_record, Order(64, shuffle=True)),  # reads record: follows the order
    (by_position, Order(64)),  # an order that moves nothing: position and record agree
    (by_position, None),  # no order
])
def test_no_order_warning_where_the_callback_follows_the_order(source, order):
    import warnings

    from extsrc import OrderWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", OrderWarning)
        with ParallelSource(source, 8, num_workers=2, order=order) as src:
            it = iter(src)
            for _ in range(8):  # an epoch of an order; without one, as many batches
                next(it)
