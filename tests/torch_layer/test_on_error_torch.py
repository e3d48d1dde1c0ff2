"""from_dataset(on_error=...): a sample whose __getitem__ raises is skipped or replaced, the
batch collated as default_collate collates the samples left."""

import pytest
import torch

from extsrc.torch import from_dataset

from sample_datasets import BadImages, Records


def test_skip_collates_the_batch_without_the_bad_sample_and_lists_it():
    dataset = BadImages(64, (7, 40))
    with from_dataset(dataset, batch_size=8, num_workers=2, on_error="skip") as loader:
        batches = list(loader)
        labels = [int(x) for batch in batches for x in batch["label"]]
        assert labels == [i for i in range(64) if i not in (7, 40)]
        assert [len(batch["label"]) for batch in batches] == [7, 8, 8, 8, 8, 7, 8, 8]
        expected = torch.utils.data.default_collate([Records(64, "dict")[i] for i in range(40, 48) if i != 40])
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
