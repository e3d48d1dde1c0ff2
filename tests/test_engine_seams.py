"""What the engine offers its layers beyond sources and pools, without any layer: an epoch's
table published to workers, a nested sample's structure, a cursor of batches handed on."""

from __future__ import annotations

import collections
import multiprocessing
import pickle

import numpy as np
import pytest

from extsrc.engine import (HEAP_BUFFERS, Cursor, EpochTable, Flattener, PackedLayout, check_same,
                           container, pack_whole)

Point = collections.namedtuple("Point", "x y")


def _read_in_child(table: EpochTable, epoch_idx: int, queue) -> None:
    try:
        queue.put(("ok", table.read(epoch_idx), table.batch(epoch_idx, 1)))
    except Exception as exc:  # the parent asserts on it
        queue.put(("error", f"{type(exc).__name__}: {exc}", None))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_epoch_table_reaches_workers_of_either_start_method(method):
    table = EpochTable()
    try:
        table.write(3, [[4, 1], [0, 2]])
        context = multiprocessing.get_context(method)
        queue = context.Queue()
        child = context.Process(target=_read_in_child, args=(table, 3, queue))
        child.start()
        outcome = queue.get(timeout=60)
        child.join(60)
        assert outcome == ("ok", [[4, 1], [0, 2]], [0, 2])
    finally:
        table.close()


def test_an_epoch_table_keeps_the_last_two_epochs_and_nothing_after_close():
    table = EpochTable()
    for epoch in range(3):
        table.write(epoch, [epoch])
    assert table.read(2) == [2] and table.read(1) == [1]
    with pytest.raises(RuntimeError, match="epoch 0"):
        table.read(0)
    with pytest.raises(StopIteration):
        table.batch(2, 1)
    table.close()
    with pytest.raises(RuntimeError, match="epoch 2"):
        table.read(2)


def test_a_nested_sample_flattens_to_its_structure_and_arrays():
    flatten = Flattener()
    sample = {"image": np.arange(6, dtype=np.uint8).reshape(2, 3), "label": 7, "where": Point(1.5, 2)}
    encoded, *leaves = flatten(sample, "record 0")
    assert [leaf.dtype for leaf in leaves] == [np.uint8, np.int64, np.float64, np.int64]
    structure = pickle.loads(encoded.tobytes())
    same_keys_other_order = {"label": 8, "where": Point(0.0, 1), "image": np.zeros((2, 3), np.uint8)}
    check_same([structure, pickle.loads(flatten(same_keys_other_order, "record 1")[0].tobytes())])
    with pytest.raises(TypeError, match=r"record 2 is \{'image': tensor\}.*first sample"):
        flatten({"image": np.zeros(3)}, "record 2")
    with pytest.raises(TypeError, match=r"record 3\['label'\].*found <class 'set'>"):
        Flattener()({"label": {1}}, "record 3")


def test_a_whole_batch_packs_into_one_buffer_and_describes_each_leaf():
    batch = {"x": np.arange(5, dtype=np.float32), "names": ["a", "b"], "n": 2, "extra": {1, 2}}
    description, buffer = pack_whole(batch, HEAP_BUFFERS, "batch 0")
    layout: PackedLayout = pickle.loads(description.tobytes())
    dtype, shape, offset = layout.leaves[-1]  # the keys in a fixed order: 'extra', 'n', 'names', 'x'
    x = buffer[offset:offset + 20].view(dtype).reshape(shape)
    np.testing.assert_array_equal(x, batch["x"])
    kinds = dict(zip(layout.structure[1][2], (child[0] for child in layout.structure[2])))
    # a NumPy array is given back as NumPy's (a layer's arrays, e.g. tensors, are "array")
    assert kinds == {"extra": "pickled", "n": "scalar", "names": "sequence", "x": "ndarray"}
    assert container(layout.structure, [1, 2, 3, 4], list) == {"x": 4, "names": 3, "n": 2, "extra": 1}


def test_a_cursor_moves_past_items_handed_on_ahead_and_may_be_told_twice():
    cursor = Cursor(0)
    for item in (2, 3, 2):
        cursor.hand(item)
    assert cursor.next == 0 and cursor.handed_out() == [2, 3]
    cursor.hand(0)
    assert cursor.next == 1
    cursor.hand(1)
    cursor.hand(1)
    assert cursor.next == 4 and cursor.handed_out() == []
    assert Cursor(5, [5, 6, 9]).next == 7
