"""A sample's structure learnt from the first one: the samples shaped like it come out as a
full walk gives them, without the walk, and any other sample is walked and judged as before."""

import collections
import re

import numpy as np
import pytest

from extsrc.engine import flattener as flattener_module
from extsrc.engine import Flattener

torch = pytest.importorskip("torch")

from extsrc.torch.structure import TENSOR_LEAVES  # noqa: E402  (needs torch)

Point = collections.namedtuple("Point", "x y")


def nested(k: int) -> dict:
    """A sample of every kind a structure carries, nested; its values depend on ``k``."""
    return {
        "image": torch.full((3, 4, 4), float(k)),
        "label": k,
        "extra": [np.arange(k, k + 3, dtype=np.int16), (k * 0.5, bool(k % 2))],
        "name": f"sample-{k}",
        "raw": bytes([k % 256]) * 3,
        "point": Point(np.float32(k), np.uint8(k % 256)),
        "ordered": collections.OrderedDict([("b", k), ("a", -k)]),
    }


def walked(sample, foreign=TENSOR_LEAVES):
    """What a Flattener that never learns gives ``sample`` (a new one walks every sample)."""
    return Flattener(foreign)(sample, "dataset[0]")


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def walks(monkeypatch):
    """How many samples the flattener walked."""
    count = []
    walk = flattener_module.flatten
    monkeypatch.setattr(flattener_module, "flatten", lambda *a, **k: count.append(1) or walk(*a, **k))
    return count


def test_samples_shaped_like_the_first_are_flattened_as_a_walk_flattens_them_without_one(walks):
    flatten = Flattener(TENSOR_LEAVES)
    expected = [walked(nested(k)) for k in range(20)]
    walks.clear()
    got = [flatten(nested(k), f"dataset[{k}]") for k in range(20)]
    assert all(same(g, e) for g, e in zip(got, expected))
    assert len(walks) == 1  # the first sample only
    assert all(g[0] is got[0][0] for g in got)  # one structure array, as the walk's cache gives


@pytest.mark.parametrize("first, later", [
    pytest.param({"a": 1, "b": 2}, {"b": 2, "a": 1}, id="keys-in-another-order"),
    pytest.param({"a": 1}, collections.defaultdict(int, a=1), id="a-dict-subclass"),
    pytest.param({"a": 1}, {"a": True}, id="an-int-then-a-bool"),
    pytest.param({"a": 1}, {"a": np.int64(2)}, id="an-int-then-a-numpy-int"),
    pytest.param([1.0], [np.float64(2.0)], id="a-float-then-a-numpy-float"),
    pytest.param(torch.zeros(2), torch.nn.Parameter(torch.ones(2)), id="a-tensor-subclass"),
    pytest.param(torch.zeros(2), torch.zeros(2, requires_grad=True), id="a-tensor-that-requires-grad"),
    pytest.param(torch.zeros(2, dtype=torch.complex64),
                 torch.zeros(2, dtype=torch.complex64).conj(), id="a-conjugate-view"),
])
def test_a_sample_that_leaves_the_learnt_structure_is_walked_and_comes_out_as_a_walk_gives_it(first, later):
    flatten = Flattener(TENSOR_LEAVES)
    flatten(first, "dataset[0]")
    assert same(flatten(later, "dataset[1]"), walked(later))


@pytest.mark.parametrize("later, field", [
    pytest.param({"image": torch.zeros(2, device="meta"), "label": 1}, "['image']", id="a-tensor-not-on-the-cpu"),
    pytest.param({"image": np.array(["a"]), "label": 1}, "['image']", id="an-array-of-strings"),
    pytest.param({"image": torch.zeros(2), "label": None}, "['label']", id="a-None"),
])
def test_a_value_the_structure_cannot_carry_is_named_by_its_field_after_the_first_sample(later, field):
    flatten = Flattener(TENSOR_LEAVES)
    flatten({"image": torch.zeros(2), "label": 0}, "dataset[0]")
    with pytest.raises(TypeError, match=re.escape(f"dataset[7]{field}")):
        flatten(later, "dataset[7]")


def test_a_sample_of_other_fields_than_the_first_is_refused_as_before():
    flatten = Flattener(TENSOR_LEAVES)
    flatten({"image": torch.zeros(2), "label": 0}, "dataset[0]")
    with pytest.raises(TypeError, match="default collation needs the same fields"):
        flatten({"image": torch.zeros(2)}, "dataset[1]")
    with pytest.raises(TypeError, match="default collation needs the same fields"):
        flatten({"image": torch.zeros(2), "label": 0, "mask": torch.zeros(2)}, "dataset[2]")
    with pytest.raises(TypeError, match="default collation needs the same fields"):
        flatten([torch.zeros(2), 0], "dataset[3]")


def test_learned_gives_nothing_before_a_first_sample_and_for_a_sample_of_another_shape():
    flatten = Flattener(TENSOR_LEAVES)
    assert flatten.learned({"a": 1}) is None
    flatten({"a": 1}, "dataset[0]")
    assert same(flatten.learned({"a": 5}), walked({"a": 5}))
    assert flatten.learned({"a": 1.5}) is None
    assert flatten.learned([1]) is None


@pytest.mark.parametrize("first, later", [
    pytest.param({1: "a", 5: 2}, {True: "a", 5: 2}, id="a-bool-key-for-an-int"),
    pytest.param({1: "a", 5: 2}, {np.int64(1): "a", 5: 2}, id="a-numpy-int-key"),
    pytest.param({"a": 1, "b": 2}, {np.str_("a"): 1, "b": 2}, id="a-numpy-str-key"),
])
def test_a_key_equal_to_the_first_samples_but_of_another_type_is_walked_and_refused(first, later):
    # The walk orders fields by the keys' repr and keeps the keys as they are: 1 and True are
    # equal keys, but these samples' fields come in another order, which collation refuses.
    flatten = Flattener(TENSOR_LEAVES)
    flatten(first, "dataset[0]")
    assert flatten.learned(later) is None
    with pytest.raises(TypeError, match="default collation needs the same fields"):
        flatten(later, "dataset[1]")


def test_a_foreign_leaf_that_gives_no_numeric_array_is_refused_with_its_field():
    class Proxy:
        """Claims to be a tensor; its array holds strings."""
        __class__ = torch.Tensor

        def numpy(self):
            return np.array(["x"])

    flatten = Flattener(TENSOR_LEAVES)
    flatten({"a": torch.zeros(2)}, "dataset[0]")
    assert flatten.learned({"a": Proxy()}) is None
    with pytest.raises(TypeError, match=re.escape("dataset[1]['a']: a NumPy array of dtype <U1")):
        flatten({"a": Proxy()}, "dataset[1]")
