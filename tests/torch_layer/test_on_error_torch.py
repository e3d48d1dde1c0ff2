"""from_dataset(on_error=...): a sample whose __getitem__ raises is skipped or replaced, the
batch collated as default_collate collates the samples left."""

import pytest
import torch

from extsrc.torch import from_dataset

from sample_datasets import BadImages, Records


def test_skip_collates_full_batches_without_the_bad_samples_and_lists_them():
    dataset = BadImages(64, (7, 40))
    good = [i for i in range(64) if i not in (7, 40)]
    with from_dataset(dataset, batch_size=8, num_workers=2, on_error="skip") as loader:
        batches = list(loader)
        labels = [int(x) for batch in batches for x in batch["label"]]
        assert labels == good  # every other sample once, the last 6 in a short last batch
        assert [len(batch["label"]) for batch in batches] == [8] * 7 + [6]
        expected = torch.utils.data.default_collate([Records(64, "dict")[i] for i in good[40:48]])
        assert torch.equal(batches[5]["image"], expected["image"])
        assert [(f.record, f.type_name) for f in loader.source.faults()] == [(7, "OSError"), (40, "OSError")]


def test_a_replacement_takes_the_samples_place():
    def placeholder(info, error):
        return Records(64, "dict")[0]

    with from_dataset(BadImages(16, (3,)), batch_size=8, num_workers=2, on_error=placeholder) as loader:
        first = next(iter(loader))
        assert [int(x) for x in first["label"]] == [0, 1, 2, 0, 4, 5, 6, 7]


@pytest.mark.parametrize("kwargs", [{"num_workers": 0}, {"collate_fn": lambda batch: batch},
                                    {"sampler": range(16)}])
def test_on_error_needs_the_per_sample_path(kwargs):
    with pytest.raises(ValueError, match="on_error='skip' needs"):
        from_dataset(BadImages(16, ()), batch_size=8, **{"num_workers": 2, **kwargs}, on_error="skip")


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_state_dict_between_two_errors_resumes_every_sample_once(shuffle):
    # Nine bad samples in the first 16 records: the loop's third batch ends in the producer's
    # fourth, and the checkpoint falls between them and record 40.
    torch.manual_seed(5)
    bad = (1, 2, 3, 4, 5, 6, 7, 9, 10, 40)
    dataset, options = BadImages(64, bad), dict(batch_size=8, num_workers=2, on_error="skip",
                                                shuffle=shuffle)
    with from_dataset(dataset, **options) as loader:
        loop = iter(loader)
        head = [int(x) for _ in range(3) for x in next(loop)["label"]]
        state = loader.state_dict()
        rest = [int(x) for batch in loop for x in batch["label"]]
    with from_dataset(dataset, **options) as resumed:
        resumed.load_state_dict(state)
        assert [int(x) for batch in resumed for x in batch["label"]] == rest
    assert sorted(head + rest) == [i for i in range(64) if i not in bad]


@pytest.mark.parametrize("taken", [3, 4])
def test_a_state_dict_among_pad_batches_resumes_the_rest_of_them(taken):
    # A shard whose 8 bad records leave it 3 batches of data and 2 of repeats: a state_dict
    # among them, and one right after the resume, still give len(source) batches in all.
    import extsrc
    from extsrc.torch import TorchLoader

    from sources import FailsOn

    order = extsrc.Order(40, shard=(1, 2))
    bad = [int(r) for r in order.epoch(0)][:8]

    def make():
        return extsrc.ParallelSource(FailsOn(40, bad), 4, num_workers=2, on_error="skip",
                                     last_batch="pad", order=order)

    def firsts(batch):
        return [int(x) for x in batch[:, 0]]

    with make() as source:
        whole = [firsts(b) for b in TorchLoader(source)]
    with make() as source:
        loader = TorchLoader(source)
        loop = iter(loader)
        head = [firsts(loop.__next__()) for _ in range(taken)]
        state = loader.state_dict()
    with make() as source:
        loader = TorchLoader(source)
        loader.load_state_dict(state)
        loop = iter(loader)
        assert loader.state_dict() == state  # nothing handed on yet: where it was saved
        middle = [firsts(loop.__next__())]
        again = loader.state_dict()  # a checkpoint of the resumed loop
    with make() as source:
        loader = TorchLoader(source)
        loader.load_state_dict(again)
        assert head + middle + [firsts(b) for b in loader] == whole
