"""from_dataset(..., in_order=False): batches as they finish, each once, as DataLoader's."""

from __future__ import annotations

import sys

import pytest
import torch

from extsrc.torch import from_dataset

from sample_datasets import FailsAt, HeldBackRecords, HeldBackStream, OddKeyRecords, ShardedStream

TIMEOUT_S = 120  # a hang fails the test instead of stalling the suite


def first_labels(batch):
    return int(batch[1][0]) // 4


@pytest.mark.parametrize("kwargs", [
    {},  # the loader's own order, collated in shared memory
    {"collate_fn": lambda samples: (torch.stack([s[0] for s in samples]),
                                    torch.tensor([s[1] for s in samples]))},
    {"sampler": list(range(32))},  # batches of a sampler's indices
], ids=["default", "collate_fn", "sampler"])
def test_a_slow_batch_holds_back_no_other(tmp_path, kwargs):
    release = tmp_path / "release"
    dataset = HeldBackRecords(32, str(release), held={0})
    with from_dataset(dataset, batch_size=4, num_workers=2, in_order=False, timeout=TIMEOUT_S,
                      **kwargs) as loader:
        got = []
        for images, labels in loader:
            assert labels.tolist() == list(range(labels[0], labels[0] + 4))
            assert torch.equal(images[:, 0], labels)
            got.append(int(labels[0]) // 4)
            if len(got) == 3:
                release.touch()
        assert 0 not in got[:3]
        assert sorted(got) == list(range(8))


def test_batches_for_the_slow_batchs_worker_go_to_the_other_one(tmp_path):
    # Were batch i made by worker i % 2 whatever happens, the worker stuck on batch 0 would hold
    # back batches 2, 4 and 6 as well (4 batches early at most); as a DataLoader's with
    # in_order=False, a batch goes to a worker with room, and only what the stuck worker took
    # beside batch 0 before it turned out slow waits with it.
    release = tmp_path / "release"
    dataset = HeldBackRecords(32, str(release), held={0})
    with from_dataset(dataset, batch_size=4, num_workers=2, in_order=False, prefetch_factor=2,
                      timeout=TIMEOUT_S) as loader:
        loop = iter(loader)
        early = [int(next(loop)[1][0]) // 4 for _ in range(5)]
        release.touch()
        rest = [int(batch[1][0]) // 4 for batch in loop]
    assert 0 not in early and sorted(early + rest) == list(range(8))


def test_state_dict_after_early_batches_resumes_with_exactly_the_rest(tmp_path):
    release = tmp_path / "release"
    dataset = HeldBackRecords(32, str(release), held={0})
    with from_dataset(dataset, batch_size=4, num_workers=2, in_order=False,
                      timeout=TIMEOUT_S) as loader:
        loop = iter(loader)
        early = [first_labels(next(loop)) for _ in range(3)]
        state = loader.state_dict()
        release.touch()
    assert state["handed_out"] == sorted(early)
    with from_dataset(HeldBackRecords(32, str(release), held=()), batch_size=4,
                      num_workers=2) as resumed:
        resumed.load_state_dict(state)
        rest = [first_labels(batch) for batch in resumed]
    assert sorted(early + rest) == list(range(8))


def test_an_error_comes_in_its_place_and_the_loop_goes_on_without_repeats(tmp_path):
    release = tmp_path / "release"
    # Batch 0 is held back; record 9 (batch 2) fails.
    dataset = HeldBackRecords(32, str(release), held={0}, fails=9)
    with from_dataset(dataset, batch_size=4, num_workers=2, in_order=False,
                      timeout=TIMEOUT_S) as loader:
        loop = iter(loader)
        got = [first_labels(next(loop)) for _ in range(3)]
        assert 2 not in got and 0 not in got
        release.touch()
        while True:
            try:
                got.append(first_labels(next(loop)))
            except ValueError as error:
                assert "record 9 is damaged" in str(error)
                got.append("error")
            except StopIteration:
                break
    assert sorted(g for g in got if g != "error") == [0, 1, 3, 4, 5, 6, 7]
    assert got.count("error") == 1
    assert got.index("error") > got.index(0)  # after the batches before it


def test_an_iterable_dataset_gives_the_batches_of_a_worker_that_is_ready(tmp_path):
    release = tmp_path / "release"
    with from_dataset(HeldBackStream(24, str(release)), batch_size=2, num_workers=2,
                      in_order=False, timeout=TIMEOUT_S) as loader:
        got = []
        for batch in loader:
            got.append(batch.tolist())
            if len(got) == 2:
                assert all(x % 2 == 1 for b in got for x in b)  # worker 1's, while 0 waits
                release.touch()
    assert sorted(x for b in got for x in b) == list(range(24))


def test_a_batch_that_cannot_be_collated_fails_in_its_place_and_the_loop_goes_on(tmp_path):
    release = tmp_path / "release"
    # Record 13 (batch 3) has another key, so its batch cannot be collated; batch 0 is held
    # back until a batch came early.
    dataset = OddKeyRecords(32, odd=13, release=str(release), held={0})
    events = []
    with from_dataset(dataset, batch_size=4, num_workers=2, in_order=False,
                      timeout=TIMEOUT_S) as loader:
        loop = iter(loader)
        while True:
            try:
                events.append(int(next(loop)["x"][0]) // 4)
            except StopIteration:
                break
            except (TypeError, KeyError, ValueError) as error:
                assert "13" in str(error), error  # names the record
                events.append("error")
            release.touch()
    assert events.count("error") == 1
    assert {0, 1, 2} <= set(events[:events.index("error")])  # in its place
    assert sorted(e for e in events if e != "error") == [0, 1, 2, 4, 5, 6, 7]


@pytest.mark.parametrize("in_order", [True, False])
def test_state_dict_after_the_last_batch_failed_points_at_the_end_of_its_epoch(in_order):
    # As after a last batch that came: resuming there gives the rest of that epoch (nothing),
    # then the next one; the failed batch is not made again.
    with from_dataset(FailsAt(32, fails=30), batch_size=4, num_workers=2, in_order=in_order,
                      timeout=TIMEOUT_S) as loader:
        got = []
        with pytest.raises(ValueError, match="record 30 is damaged"):
            for batch in loader:
                got.append(int(batch[0]) // 4)
        assert sorted(got) == list(range(7))
        state = loader.state_dict()
    assert (state["epoch_idx"], state["iteration"]) == (0, 8)
    with from_dataset(FailsAt(32, fails=-1), batch_size=4, num_workers=2) as resumed:
        resumed.load_state_dict(state)
        assert [int(batch[0]) // 4 for batch in resumed] == []
        assert [int(batch[0]) // 4 for batch in resumed] == list(range(8))


def interrupt_at_call(name, file_part):
    """A KeyboardInterrupt at the start of the next call of ``name`` (in a file ending with
    ``file_part``), as a Ctrl-C could land."""
    def trace(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name == name and code.co_filename.endswith(file_part):
            sys.settrace(None)
            raise KeyboardInterrupt(name)
    sys.settrace(trace)


@pytest.mark.parametrize("where", [("next", "take.py"), ("handed", "position.py"),
                                   ("_tensors", "loader.py")])
@pytest.mark.parametrize("in_order", [True, False])
def test_an_interrupt_while_the_loop_goes_on_after_an_error_loses_no_batch(in_order, where):
    got, interrupts, errors = [], 0, 0
    with from_dataset(FailsAt(32, fails=9), batch_size=4, num_workers=2, in_order=in_order,
                      timeout=TIMEOUT_S) as loader:
        loop = iter(loader)
        while True:
            try:
                # Armed until it lands, from batch 2 on (in order, the next is the error) or from
                # the error on: out of order, batch 2's error may come before two batches did.
                if (len(got) >= 2 or errors) and not interrupts:
                    interrupt_at_call(*where)  # lands while going on after batch 2's error
                got.append(int(loop.__next__()[0]) // 4)
            except StopIteration:
                break
            except KeyboardInterrupt:
                interrupts += 1
            except ValueError:
                errors += 1
            finally:
                sys.settrace(None)
    assert interrupts == 1 and sorted(got) == [0, 1, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("in_order", [True, False])
def test_an_interrupt_inside_next_leaves_an_iterable_dataset_loop_going_on(in_order):
    with from_dataset(ShardedStream(40), batch_size=4, num_workers=2, in_order=in_order,
                      timeout=TIMEOUT_S) as loader:
        loop = iter(loader)
        got = loop.__next__()["i"].tolist()
        interrupt_at_call("__next__", "loader.py")
        with pytest.raises(KeyboardInterrupt):
            loop.__next__()
        for batch in loop:
            got += batch["i"].tolist()
    assert sorted(got) == list(range(40))
