"""on_error= and max_errors=: a sample the callback fails on is skipped (its batch refilled from
the next) or replaced, counted and listed, and the epoch goes on; past the budget the source
raises with the list."""

import json
import sys
import time

import numpy as np
import pytest

import extsrc
from extsrc import Order, ParallelSource, TooManyErrorsError

from interrupting import interrupt_at_landing
from sources import FailsOn, minus_record

BAD = (7, 300)


def _records(batches):
    return [int(sample[0]) for batch in batches for sample in batch]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("concurrency", [1, 3])
def test_skip_gives_every_other_record_once_and_lists_the_bad_ones(start_method, concurrency):
    with ParallelSource(FailsOn(1000, BAD), 16, num_workers=2, start_method=start_method,
                        concurrency=concurrency, on_error="skip", last_batch="partial") as source:
        for _ in range(2):  # the epoch after goes the same
            batches = list(source)
            assert _records(batches) == [r for r in range(1000) if r not in BAD]
            sizes = [len(batch) for batch in batches]
            # Full batches: the samples after a skipped one move up; the last holds what is left.
            assert sizes == [16] * 62 + [998 - 62 * 16]
        faults = source.faults()
        assert [f.record for f in faults] == [7, 300, 7, 300]
        assert faults[1].type_name == "OSError" and "cannot decode record 300" in faults[1].message
        assert (faults[1].iteration, faults[1].idx_in_batch, faults[1].replaced) == (18, 12, False)
        assert "record 300" in str(faults[1]) and "skipped" in str(faults[1])
        stats = source.stats()
        assert (stats.skipped, stats.replaced) == (4, 0)
        assert "4 skipped" in str(stats)


def test_skip_leaves_a_sample_out_of_every_output_of_a_tuple():
    with ParallelSource(FailsOn(64, (3,), outputs=2), 8, num_outputs=2, num_workers=2,
                        on_error="skip") as source:
        epoch = iter(source)
        first, tails = next(epoch)
        assert [int(s[0]) for s in first] == [0, 1, 2, 4, 5, 6, 7, 8]
        assert [len(t) for t in tails] == [r % 3 for r in (0, 1, 2, 4, 5, 6, 7, 8)]
        second, _ = next(epoch)
        assert [int(s[0]) for s in second] == list(range(9, 17))


def test_a_replacement_comes_in_place_of_the_sample():
    with ParallelSource(FailsOn(64, (3, 40)), 8, num_workers=2, start_method="spawn",
                        on_error=minus_record) as source:
        batches = list(source)
        assert all(len(batch) == 8 for batch in batches)
        assert _records(batches) == [-r if r in (3, 40) else r for r in range(64)]
        assert [(f.record, f.replaced) for f in source.faults()] == [(3, True), (40, True)]
        assert source.stats().replaced == 2


def test_a_replacement_that_raises_fails_the_batch_with_its_error():
    def refuse(info, error):
        raise ValueError(f"no replacement for {info.record}") from error

    with ParallelSource(FailsOn(32, (9,)), 8, num_workers=2, on_error=refuse) as source:
        epoch = iter(source)
        next(epoch)
        with pytest.raises(ValueError, match="no replacement for 9"):
            next(epoch)
        assert len(next(epoch)) == 8  # the epoch goes on
        assert source.faults() == []


def test_past_max_errors_the_batch_raises_with_every_error_of_the_epoch():
    with ParallelSource(FailsOn(1000, (7, 300, 500)), 16, num_workers=2, on_error="skip",
                        max_errors=1, last_batch="partial") as source:
        epoch = iter(source)
        # 17 batches hold the 271 good records of the first 272: one error, in the budget.
        taken = [next(epoch) for _ in range(17)]
        with pytest.raises(TooManyErrorsError) as raised:
            next(epoch)  # it needs records 272-288, and record 300 is in their producer's batch
        assert [f.record for f in raised.value.faults] == [7, 300]
        assert "max_errors=1" in str(raised.value) and "record 7" in str(raised.value)
        assert [len(batch) for batch in taken] == [16] * 17


def test_max_errors_as_a_fraction_of_an_ordered_epoch():
    bad = range(0, 100, 10)  # 10% of the records
    with ParallelSource(FailsOn(100, bad), 10, num_workers=2, on_error="skip", max_errors=0.1,
                        order=Order(100)) as source:
        assert len(_records(source)) == 90
    with ParallelSource(FailsOn(100, bad), 10, num_workers=2, on_error="skip", max_errors=0.05,
                        order=Order(100)) as source:
        with pytest.raises(TooManyErrorsError):
            list(source)


def test_a_checkpoint_between_two_errors_resumes_every_record_once_and_keeps_the_count():
    def run(state=None, stop_after=None):
        with ParallelSource(FailsOn(1000, BAD), 16, num_workers=2, on_error="skip", max_errors=1,
                            order=Order(1000, shuffle=True, seed=3),
                            last_batch="partial") as source:
            if state is not None:
                source.set_state(state)
            epoch, got = iter(source), []
            try:
                for k, batch in enumerate(epoch):
                    got.extend(int(s[0]) for s in batch)
                    if stop_after is not None and k + 1 == stop_after:
                        return got, source.get_state()
            except TooManyErrorsError as exc:
                return got, exc
        return got, None

    whole, error = run()
    assert isinstance(error, TooManyErrorsError)  # 2 errors, budget 1
    shuffled = Order(1000, shuffle=True, seed=3)
    order = [shuffled.record(0, position) for position in range(1000)]
    first_bad = min(order.index(r) for r in BAD)
    split = first_bad // 16 + 2  # a checkpoint after the first error, before the second
    head, state = run(stop_after=split)
    assert state["faults"] == 1
    tail, error = run(state)
    assert isinstance(error, TooManyErrorsError)  # the budget counts the error before the resume
    assert head + tail == whole and len(set(whole)) == len(whole)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_checkpoint_in_a_refilled_batch_resumes_every_record_once(start_method):
    # Without an order; the checkpoint falls after the first error, before the second, and
    # the next producer's batch is half handed out already.
    options = dict(num_workers=2, start_method=start_method, on_error="skip", last_batch="partial")
    with ParallelSource(FailsOn(1000, BAD), 16, **options) as source:
        epoch = iter(source)
        head = _records([next(epoch) for _ in range(5)])
        state = json.loads(json.dumps(source.get_state()))  # as a checkpoint file keeps it
    assert state["refill"]["carry"] and state["faults"] == 1
    with ParallelSource(FailsOn(1000, BAD), 16, **options) as resumed:
        resumed.set_state(state)
        tail = _records(resumed)
        assert [f.record for f in resumed.faults()] == [300]
        with pytest.raises(extsrc.StateMismatchError, match="same batch_size"):
            ParallelSource(FailsOn(1000, BAD), 8, **options).set_state(state)
    assert head + tail == [r for r in range(1000) if r not in BAD]


def test_pad_keeps_every_rank_at_len_batches_whatever_it_skipped():
    # Two shards of 100 records, one with 12 bad ones: both give len() full batches.
    for shard, bad_count in ((0, 0), (1, 12)):
        order = Order(200, shard=(shard, 2))
        mine = [int(r) for r in order.epoch(0)]
        bad = mine[:bad_count]
        with ParallelSource(FailsOn(200, bad), 8, num_workers=2, on_error="skip",
                            last_batch="pad", order=order) as source:
            batches = list(source)
            assert len(batches) == len(source) == 13 and {len(b) for b in batches} == {8}
            assert set(_records(batches)) == set(mine) - set(bad)


def test_errors_that_are_not_the_callbacks_still_fail_the_batch():
    def wrong_dtype(info):
        if info.idx_in_epoch >= 16:
            raise StopIteration
        return np.zeros(2, np.float32 if info.idx_in_epoch == 5 else np.int64)

    with ParallelSource(wrong_dtype, 8, num_workers=1, on_error="skip") as source:
        epoch = iter(source)
        with pytest.raises(extsrc.SampleError):
            next(epoch)
        assert source.faults() == []


def test_a_batch_whose_every_sample_failed_is_filled_from_the_next():
    with ParallelSource(FailsOn(40, range(8, 20)), 8, num_workers=2, on_error="skip",
                        last_batch="partial") as source:
        assert [_records([batch]) for batch in source] == [
            list(range(8)), list(range(20, 28)), list(range(28, 36)), list(range(36, 40))]
        assert len(source.faults()) == 12


def test_the_list_of_faults_keeps_the_newest_and_the_count_keeps_them_all():
    from extsrc.engine.policy import FAULTS_LISTED

    bad = range(1, 2 * FAULTS_LISTED + 400, 2)  # more bad records than are listed
    with ParallelSource(FailsOn(2 * FAULTS_LISTED + 400, bad), 64, num_workers=2, on_error="skip",
                        last_batch="partial") as source:
        assert _records(source) == list(range(0, 2 * FAULTS_LISTED + 400, 2))
        assert [f.record for f in source.faults()] == list(bad)[-FAULTS_LISTED:]
        assert source.stats().skipped == len(bad)


def test_a_batch_callable_may_replace_its_batch():
    def batches(info):
        if info.iteration >= 4:
            raise StopIteration
        if info.iteration == 2:
            raise OSError("shard 2 is gone")
        return np.full((4, 2), info.iteration, np.int64)

    def stand_in(info, error):
        return np.full((4, 2), -1, np.int64)

    with ParallelSource(batches, 4, batch=True, num_workers=2, on_error=stand_in,
                        hooks=extsrc.Hooks(batch_info=True)) as source:
        assert [int(b[0][0]) for b in source] == [0, 1, -1, 3]
        assert [(f.iteration, f.type_name) for f in source.faults()] == [(2, "OSError")]


@pytest.mark.parametrize("kwargs, message", [
    ({"on_error": "ignore"}, "on_error must be one of"),
    ({"on_error": "raise", "max_errors": 3}, "with on_error='raise'"),
    ({"on_error": "skip", "max_errors": 0.5}, "only an order= knows"),
    ({"on_error": "skip", "max_errors": -1}, "max_errors must be"),
    ({"on_error": "skip", "batch": True}, "needs sample mode"),
])
def test_wrong_on_error_arguments_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelSource(FailsOn(8, ()), 4, num_workers=1, **kwargs)


def test_an_iterable_cannot_replace_its_batches():
    with pytest.raises(ValueError, match="needs a callable source"):
        ParallelSource([np.zeros((2, 2))], 2, batch=True, num_workers=1, on_error=minus_record)


def test_an_async_sources_stop_iteration_still_ends_the_epoch():
    # In a coroutine StopIteration becomes a RuntimeError: it was taken for a failed sample
    # (replaced or skipped for ever after the epoch's end).
    from sources import async_until_16

    for on_error in ("skip", minus_record):
        with ParallelSource(async_until_16, 8, num_workers=2, on_error=on_error) as source:
            assert _records(source) == list(range(16)) and source.faults() == []


def test_skip_never_takes_extsrcs_own_errors_for_bad_data():
    def in_place(info, buffers):
        if info.idx_in_epoch >= 8:
            raise StopIteration
        out = buffers.array((2,), np.uint8 if info.idx_in_epoch % 2 else np.float32)
        out[...] = info.idx_in_epoch
        return out

    with ParallelSource(in_place, 4, num_workers=1, in_place=True, dtype=np.float32,
                        on_error="skip") as source:
        with pytest.raises(extsrc.SampleError, match="expected dtype float32"):
            next(iter(source))
        assert source.faults() == []


def _first_task_skipped_late(info):
    """FailsOn(64, (0, 1, 17), outputs=2) whose records 0 and 1 fail late: another task tells
    the number of outputs first, then a task whose every sample was skipped answers."""
    if info.idx_in_epoch < 2:
        time.sleep(0.2)
    return FailsOn(64, (0, 1, 17), outputs=2)(info)


def test_a_task_skipped_whole_before_the_outputs_are_known_is_no_error():
    with ParallelSource(_first_task_skipped_late, 8, num_outputs="auto", num_workers=2, prefetch=1,
                        on_error="skip") as source:
        firsts = [int(s[0]) for images, _ in source for s in images]
        # 61 good records make 7 full batches; last_batch="drop" drops the 5 left.
        assert firsts == [r for r in range(64) if r not in (0, 1, 17)][:56]


def _slow_first_batch(info):
    """FailsOn(64, (9, 17, 25)) whose record 0 takes a second in epoch 0: with in_order=False
    batches 1 and 2 (one bad record each) are handed out before batch 0."""
    if info.idx_in_epoch == 0 and info.epoch_idx == 0:
        time.sleep(1.0)
    return FailsOn(64, (9, 17, 25))(info)


def test_a_state_saved_out_of_order_resumes_every_record_once_and_keeps_the_count():
    options = dict(num_workers=2, on_error="skip", max_errors=3, in_order=False, last_batch="partial")
    with ParallelSource(_slow_first_batch, 8, **options) as source:
        epoch = iter(source)
        head = _records([next(epoch) for _ in range(2)])  # batch 0 is slow: from later ones
        state = source.get_state()
    assert len(head) == 16 and min(head) >= 8
    with ParallelSource(_slow_first_batch, 8, **options) as resumed:
        resumed.set_state(state)
        tail = _records(resumed)
        # Each bad record is counted once: before the checkpoint or after the resume.
        assert state.get("faults", 0) + len(resumed.faults()) == 3
    assert sorted(head + tail) == [r for r in range(64) if r not in (9, 17, 25)]


def test_overflow_of_a_batch_ended_before_a_failure_is_kept_while_read():
    # The epoch ends at record 4 (StopIteration) and the worker past it fails (IndexError):
    # the batch is handed out, and its samples in the failed task's worker's overflow must not
    # have been given back (they read as zeros).
    def ends_then_fails(info):
        record = info.idx_in_epoch
        if record == 4:
            raise StopIteration
        if record > 4:
            raise IndexError(f"no record {record}")
        time.sleep(0.05)
        return np.full(((3 << 20) if record in (2, 3) else 1000 + record) // 8, record + 1, np.int64)

    with ParallelSource(ends_then_fails, 8, num_workers=2, prefetch=1, last_batch="partial") as source:
        (batch,) = list(source)
        assert [int((np.asarray(s) == 0).sum()) for s in batch] == [0, 0, 0, 0]
        assert [int(s[0]) for s in batch] == [1, 2, 3, 4]


def test_an_epoch_whose_every_sample_failed_raises_rather_than_ending_empty():
    with ParallelSource(FailsOn(40, range(40)), 8, num_workers=2, on_error="skip") as source:
        with pytest.raises(extsrc.CallbackError, match="every sample of epoch 0 failed"):
            list(source)
        assert len(source.faults()) == 40


def test_a_state_after_the_epochs_end_points_at_the_next_epoch():
    with ParallelSource(FailsOn(40, (3,)), 8, num_workers=2, on_error="skip") as source:
        assert len(list(source)) == 4  # 39 good records: 7 left over, dropped
        state = source.get_state()
    assert (state["epoch_idx"], state["iteration"]) == (1, 0) and "refill" not in state


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # a Ctrl-C lost
def test_an_interrupt_at_any_place_of_a_refill_loses_and_repeats_nothing():
    # Epoch k is cut once, at the k-th place a Ctrl-C can land in the refill (counted from the
    # epoch's start), and the loop goes on after it; k = 1, 2, ... until an epoch has no k-th.
    import extsrc.engine.refill as refill

    bad = (2, 9, 10)
    expected = [r for r in range(24) if r not in bad]
    with ParallelSource(FailsOn(24, bad), 4, num_workers=2, on_error="skip",
                        last_batch="partial") as source:
        k, over = 0, False
        while not over:
            k += 1
            epoch, got, landings = iter(source), [], [0]
            for _ in range(len(expected) + 1):  # at most one call per batch, one cut, the end
                sys.setprofile(interrupt_at_landing(k, landings, refill.__file__))
                try:
                    got.extend(_records([epoch.__next__()]))
                except KeyboardInterrupt:
                    pass
                except StopIteration:
                    break
                finally:
                    sys.setprofile(None)
            over = landings[0] < k
            assert got == expected, k
    assert k > 100  # the places walked


def test_a_refilled_batch_keeps_one_workers_batch_in_shared_memory():
    # Record 3 skipped: batch 0 takes record 8 from the workers' batch 1, batch 1 records 9-15
    # (views) and 16 (a copy): the smaller part of each is copied, so that a held batch keeps
    # one of the workers' batches mapped, not two.
    with ParallelSource(FailsOn(64, (3,)), 8, num_workers=2, on_error="skip") as source:
        batches = list(source)
    assert [int(s[0]) for s in batches[1]] == list(range(9, 17))
    copies = [[bool(s.flags.owndata) for s in batch] for batch in batches]
    assert copies[0] == [False] * 7 + [True] and all(c == [False] * 7 + [True] for c in copies[1:])


@pytest.mark.parametrize("taken", [3, 4])
def test_a_checkpoint_among_pad_batches_resumes_the_rest_of_them(taken):
    # Rank 1 skips 8 of its 20 records: its 5 batches end in repeats, and a resume among
    # them still gives len(source) batches in all.
    order = Order(40, shard=(1, 2))
    bad = [int(r) for r in order.epoch(0)][:8]

    def make():
        return ParallelSource(FailsOn(40, bad), 4, num_workers=2, on_error="skip",
                              last_batch="pad", order=order)

    with make() as source:
        whole = [_records([b]) for b in source]
    with make() as source:
        epoch = iter(source)
        head = [_records([epoch.__next__()]) for _ in range(taken)]
        state = json.loads(json.dumps(source.get_state()))
    with make() as resumed:
        resumed.set_state(state)
        assert head + [_records([b]) for b in resumed] == whole
    assert len(whole) == 5


def test_a_checkpoint_after_a_batch_that_raised_resumes_after_it():
    def make():
        return ParallelSource(FailsOn(24, (5, 13)), 4, num_workers=2, on_error="skip",
                              max_errors=1, last_batch="partial")

    def steps(epoch, most=99):
        out = []
        while len(out) < most:
            try:
                out.append(_records([epoch.__next__()]))
            except StopIteration:
                break
            except TooManyErrorsError:
                out.append("error")
        return out

    with make() as source:
        whole = steps(iter(source))
    with make() as source:
        head = steps(iter(source), 3)
        state = source.get_state()
    assert head[-1] == "error" and state["faults"] == 2
    with make() as resumed:
        resumed.set_state(state)
        assert head + steps(iter(resumed)) == whole


def test_dense_arrays_of_other_shapes_are_joined_as_a_batch():
    with ParallelSource(FailsOn(24, (13, 14), outputs=2), 4, num_outputs=2, num_workers=2,
                        on_error="skip", last_batch="partial",
                        hooks=extsrc.Hooks(dense_arrays=True)) as source:
        firsts = [int(s[0]) for first, _ in source for s in first]
    assert firsts == [r for r in range(24) if r not in (13, 14)]


@pytest.mark.parametrize("refill, message", [
    ({"carry": [[2, 1.5]]}, "'refill' must be"), ({"carry": [[2, 4]]}, "0 < count < batch_size"),
    ({"carry": [[0, 2]]}, "at or after the state's iteration"), ({"given": "2"}, "'given': int"),
])
def test_a_malformed_refill_state_says_what_was_expected(refill, message):
    state = {"epoch_idx": 0, "iteration": 2, "batch_size": 4, "refill": refill}
    with ParallelSource(FailsOn(24, ()), 4, num_workers=1, on_error="skip") as source:
        with pytest.raises(ValueError, match=message.replace("(", "\\(")):
            source.set_state(state)
