"""torchdata nodes over a parallel ``extsrc.dynamic.ExternalSource``: epochs and exact resume."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchdata")

import torchdata.nodes as tn  # noqa: E402

import extsrc.dynamic as ndd  # noqa: E402
from extsrc import Order, SampleInfo  # noqa: E402
from extsrc.dynamic.nodes import ExternalSource as SourceNode  # noqa: E402


def record_and_label(info: SampleInfo):
    return np.array([info.record], np.int64), np.array([info.record % 10], np.int32)


def make_loader(**node_options):
    source = ndd.ExternalSource(record_and_label, 2, parallel=True, batch_size=4, num_workers=2,
                                order=Order(24, shuffle=True, seed=5))
    return source, tn.Loader(SourceNode(source, **node_options))


def records(batch) -> list:
    return np.asarray(ndd.as_tensor(batch["data"])).ravel().tolist()


def test_each_loop_of_the_loader_is_one_epoch_of_named_outputs():
    source, loader = make_loader()
    with source:
        epochs = [[records(b) for b in loader] for _ in range(2)]
        first = next(iter(loader))
    assert [len(e) for e in epochs] == [6, 6]
    assert sorted(sum(epochs[0], [])) == list(range(24)) and epochs[0] != epochs[1]  # reshuffled
    assert set(first) == {"data", "label"}


def test_a_loop_broken_off_starts_the_next_epoch_from_its_start():
    source, loader = make_loader()
    with source:
        loop = iter(loader)
        next(loop)
        next(loop)
        second = [records(b) for b in loader]
    assert len(second) == 6 and sorted(sum(second, [])) == list(range(24))


def test_load_state_dict_resumes_exactly_where_state_dict_was_taken():
    source, loader = make_loader()
    with source:
        loop = iter(loader)
        for _ in range(3):
            next(loop)
        state = loader.state_dict()
        expected = [records(next(loop)) for _ in range(3)]
    source, loader = make_loader()
    with source:
        loader.load_state_dict(state)
        assert [records(b) for b in loader] == expected


def test_a_source_without_parallel_or_with_other_outputs_is_refused():
    with pytest.raises(TypeError, match="made with parallel=True"):
        SourceNode(ndd.ExternalSource(lambda: np.zeros(2)))
    source, _ = make_loader()
    with source, pytest.raises(ValueError, match="2 output"):
        SourceNode(source, output_names=("only",))


def test_an_epoch_after_one_left_early_with_skipped_samples_is_whole():
    def fails_on_one(info: SampleInfo) -> np.ndarray:
        if info.idx_in_epoch >= 24:
            raise StopIteration
        if info.idx_in_epoch == 1:
            raise OSError("record 1 is damaged")
        return np.array([info.idx_in_epoch], np.int64)

    def records(batch):
        data = batch["data"]
        return [int(np.asarray(data.select(i))[0]) for i in range(data.batch_size)]

    with ndd.ExternalSource(fails_on_one, parallel=True, batch_size=4, num_workers=2,
                            on_error="skip", last_batch="partial") as es:
        loader = tn.Loader(SourceNode(es))
        for k, _ in enumerate(loader):  # left after two batches, in a refilled one's middle
            if k == 1:
                break
        second = [r for batch in loader for r in records(batch)]
    assert second == [r for r in range(24) if r != 1]
