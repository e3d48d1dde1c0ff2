"""DALI's PyTorch iterators over extsrc pipelines: every last-batch policy of the source and of the
iterator, with ``reader_name=`` (the source's ``reader_meta``), with ``size=``, and with neither."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from extsrc import Order, fn, pipeline_def
from dali_support import extsrc_workers

torch = pytest.importorskip("torch")
from nvidia.dali.plugin.pytorch import (  # noqa: E402  (needs torch)
    DALIClassificationIterator,
    DALIGenericIterator,
    LastBatchPolicy,
)

CPU = dict(num_threads=1, device_id=None)
RECORDS, BATCH = 10, 4
POLICIES = [LastBatchPolicy.FILL, LastBatchPolicy.DROP, LastBatchPolicy.PARTIAL]
EPOCHS = 3


def record_of(info):
    """Sample: the record the order put at this position, and the epoch it was loaded for."""
    return np.array([info.record, info.epoch_idx], np.int64)


def image_and_label(info):
    return np.full((2, 2, 3), info.record, np.uint8), np.array([info.record * 10], np.int32)


def _pipe(last_batch, order=None, batch_size=BATCH, **kwargs):
    order = order if order is not None else Order(RECORDS, shuffle=True, seed=7)

    @pipeline_def(batch_size=batch_size, py_num_workers=1, **CPU, **kwargs)
    def pipe():
        return fn.external_source(record_of, parallel=True, order=order, last_batch=last_batch,
                                  name="src")

    return pipe()


def _source_batches(order, epoch, last_batch, batch_size=BATCH):
    """What the source yields in ``epoch``: lists of records."""
    records = list(order.epoch(epoch))
    full, rest = divmod(len(records), batch_size)
    batches = [records[i * batch_size:(i + 1) * batch_size] for i in range(full)]
    if rest and last_batch == "partial":
        batches.append(records[full * batch_size:])
    if rest and last_batch == "pad":
        batches.append(records[full * batch_size:] + records[:batch_size - rest])
    return batches


def _expected(order, epoch, last_batch, policy, mode):
    """What the iterator yields in ``epoch``: lists of records (see README: DALI's iterators)."""
    batches = _source_batches(order, epoch, last_batch)
    if mode == "none" or last_batch == "drop":
        return batches  # without reader_name/size, DALI ignores the policy
    # last_batch == "pad": the last batch holds `rest` real records, then padding
    rest = len(order) % BATCH
    if rest and policy is LastBatchPolicy.DROP:
        return batches[:-1]
    if rest and policy is LastBatchPolicy.PARTIAL:
        return batches[:-1] + [batches[-1][:rest]]
    return batches


def _iterator(pipe, mode, policy, cls=DALIGenericIterator, names=("x",)):
    kwargs = dict(last_batch_policy=policy)
    if mode == "reader":
        kwargs["reader_name"] = "src"
    elif mode == "size":
        kwargs["size"] = pipe.epoch_size("src")
        kwargs["last_batch_padded"] = True  # each epoch of the source starts afresh
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DALI recommends reader_name= over size=
        if cls is DALIClassificationIterator:
            return cls(pipe, **kwargs)
        return cls(pipe, list(names), **kwargs)


def _run(iterator, epochs=EPOCHS):
    """Records per batch per epoch; checks that every sample was loaded for its epoch."""
    got = []
    for epoch in range(epochs):
        batches = []
        for (outputs,) in iterator:
            x = outputs["x"].numpy()
            assert (x[:, 1] == epoch).all(), f"epoch {epoch} got samples of epochs {set(x[:, 1])}"
            batches.append(x[:, 0].tolist())
        got.append(batches)
    return got


@pytest.mark.parametrize("mode", ["reader", "size", "none"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("last_batch", ["drop", "pad"])
def test_generic_iterator_applies_the_policies_over_epochs(last_batch, policy, mode):
    order = Order(RECORDS, shuffle=True, seed=7)
    with _pipe(last_batch, order) as pipe:
        iterator = _iterator(pipe, mode, policy)
        got = _run(iterator)
        expected = [_expected(order, e, last_batch, policy, mode) for e in range(EPOCHS)]
        assert got == expected
        if mode != "none":
            assert len(iterator) == len(expected[0])
    assert extsrc_workers() == []


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_partial_source_without_reader_name_or_size_gives_its_shorter_last_batch(policy):
    order = Order(RECORDS, shuffle=True, seed=7)
    with _pipe("partial", order) as pipe:
        got = _run(_iterator(pipe, "none", policy))
    assert got == [_source_batches(order, e, "partial") for e in range(EPOCHS)]
    assert [len(b) for b in got[0]] == [4, 4, 2]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_partial_source_with_reader_name_is_refused_saying_what_to_use(policy):
    with _pipe("partial") as pipe:
        with pytest.raises(ValueError, match=r"last_batch='pad'.*LastBatchPolicy.PARTIAL"):
            _iterator(pipe, "reader", policy)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_partial_source_with_size_fails_in_dali_and_pad_with_partial_gives_the_same_batches(policy):
    order = Order(RECORDS)
    with _pipe("partial", order) as pipe:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            iterator = DALIGenericIterator(pipe, ["x"], size=RECORDS, last_batch_policy=policy)
        with pytest.raises(AssertionError, match="Variable batch size is not supported"):
            list(iterator)
    # What the README recommends instead: the same batches as the partial source alone.
    with _pipe("pad", order) as pipe:
        got = _run(_iterator(pipe, "reader", LastBatchPolicy.PARTIAL), epochs=2)
    assert got == [_source_batches(order, e, "partial") for e in range(2)]


def test_reader_meta_without_an_order_says_so():
    def counting(info):
        if info.idx_in_epoch >= RECORDS:
            raise StopIteration
        return np.array([info.idx_in_epoch], np.int64)

    @pipeline_def(batch_size=BATCH, py_num_workers=1, **CPU)
    def pipe():
        return fn.external_source(counting, parallel=True, batch=False, name="src")

    with pipe() as p:
        with pytest.raises(ValueError, match="no order="):
            p.reader_meta("src")
        assert "src" not in p.reader_meta()


def _file_reader_pipe(folder, pad):
    from nvidia.dali import fn as dali_fn
    from nvidia.dali import pipeline_def as dali_pipeline_def

    @dali_pipeline_def(batch_size=BATCH, **CPU)
    def pipe():
        data, label = dali_fn.readers.file(file_root=str(folder), pad_last_batch=pad, name="src")
        return data, label

    return pipe()


@pytest.fixture
def ten_files(tmp_path):
    folder = tmp_path / "class0"
    folder.mkdir()
    for i in range(RECORDS):
        (folder / f"{i:02d}.jpg").write_bytes(bytes([i]))  # read, never decoded
    return tmp_path


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_pad_source_with_reader_name_batches_as_dalis_file_reader(ten_files, policy):
    """The same number of batches and the same real samples as ``fn.readers.file(pad_last_batch=True)``;
    only the padding differs (the reader repeats its last sample, the order wraps around)."""
    reader = _file_reader_pipe(ten_files, pad=True)
    iterator = DALIGenericIterator(reader, ["data", "label"], reader_name="src", last_batch_policy=policy)
    theirs = [[out["data"][:, 0].tolist() for (out,) in iterator] for _ in range(2)]
    with _pipe("pad", Order(RECORDS)) as pipe:
        ours = _run(_iterator(pipe, "reader", policy), epochs=2)
    assert [[len(b) for b in epoch] for epoch in ours] == [[len(b) for b in epoch] for epoch in theirs]
    for our_epoch, their_epoch in zip(ours, theirs):
        real = min(RECORDS, sum(map(len, our_epoch)))  # DROP: 8 samples, else 10 and padding
        ours_real = [r for b in our_epoch for r in b][:real]
        assert ours_real == [r for b in their_epoch for r in b][:real] == list(range(real))
    meta_keys = set(reader.reader_meta("src"))
    with _pipe("pad") as pipe:
        assert set(pipe.reader_meta("src")) == meta_keys


def test_classification_iterator_over_a_named_two_output_source():
    order = Order(RECORDS, shuffle=True, seed=3)

    @pipeline_def(batch_size=BATCH, py_num_workers=2, **CPU)
    def pipe():
        images, labels = fn.external_source(image_and_label, num_outputs=2, parallel=True,
                                            order=order, last_batch="pad", name="src")
        return images, labels

    with pipe() as p:
        iterator = DALIClassificationIterator(p, reader_name="src",
                                              last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)
        for epoch in range(2):
            labels = []
            for (out,) in iterator:
                assert out["data"].shape[1:] == (2, 2, 3)
                assert (out["data"][:, 0, 0, 0].long() * 10 == out["label"][:, 0].long()).all()
                labels += out["label"][:, 0].tolist()
            assert labels == [r * 10 for r in order.epoch(epoch)]
    assert extsrc_workers() == []


def test_two_shards_in_one_iterator_each_read_their_own_records():
    shards = [Order(RECORDS + 1, shard=(k, 2), remainder="pad") for k in range(2)]
    pipes = [_pipe("pad", shards[k]) for k in range(2)]
    try:
        iterator = DALIGenericIterator(pipes, ["x"], reader_name="src",
                                       last_batch_policy=LastBatchPolicy.PARTIAL)
        for _ in range(2):
            seen = [[], []]
            for outputs in iterator:
                for k, out in enumerate(outputs):
                    seen[k] += out["x"][:, 0].tolist()
            assert seen == [list(shards[k].epoch(0)) for k in range(2)]
            assert len(seen[0]) == len(seen[1]) == 6  # 11 records, padded to 12: 6 per shard
    finally:
        for p in pipes:
            p.close()
