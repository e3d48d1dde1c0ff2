"""Errors reach the consumer at their batch, naming the sample, output and cause."""

import os
import signal
import time

import numpy as np
import pytest

import extsrc
from extsrc import (
    ParallelSource,
    PoolClosedError,
    SampleError,
    SourceTimeoutError,
    WorkerDiedError,
)
from extsrc.errors import WorkerTraceback

from faultkit import HANG_GUARD_S, run_isolated
from sources import StopsAt


def fails_at(n, exc):
    def source(info):
        if info.idx_in_epoch == n:
            raise exc
        return np.array([info.idx_in_epoch])

    return source


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_callback_exception_keeps_type_message_and_worker_traceback(method):
    src = ParallelSource(fails_at(13, KeyError("missing record 13")), 8, num_workers=2, start_method=method)
    with src:
        it = iter(src)
        assert len(next(it)) == 8  # batch 0 is fine
        with pytest.raises(KeyError, match="missing record 13") as caught:
            next(it)
    cause = caught.value.__cause__
    assert isinstance(cause, WorkerTraceback)
    assert "raise exc" in cause.text and "idx_in_epoch=13" in cause.text


def test_source_is_usable_for_a_new_epoch_after_a_callback_error():
    calls = {"bad": True}

    def source(info):
        if info.epoch_idx == 0 and info.idx_in_epoch == 2:
            raise ValueError("bad sample")
        return np.array([info.idx_in_epoch])

    with ParallelSource(source, 4) as src:
        with pytest.raises(ValueError):
            list(src)
        it = iter(src)
        assert [int(s[0]) for s in next(it)] == [0, 1, 2, 3]
    assert calls


class _FailsOn:
    """Record r's sample; records in ``bad`` raise ``KeyError`` naming themselves."""

    def __init__(self, bad):
        self.bad = frozenset(bad)

    def __call__(self, info):
        if info.record in self.bad:
            raise KeyError(f"record {info.record} is damaged")
        return np.array([info.record])


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_failed_batch_raises_in_its_place_and_the_epoch_goes_on(method, in_order):
    # Records 7 and 300 of 1,000 fail: their batches raise their errors where they stand, every
    # other batch comes once, whole, and the epoch ends after the last; also out of order.
    order = extsrc.Order(1000)
    with ParallelSource(_FailsOn({7, 300}), 10, num_workers=2, start_method=method, order=order,
                        in_order=in_order) as src:
        for _ in range(2):  # and the next epoch, on the same workers
            epoch, got, errors = iter(src), [], []
            while True:
                try:
                    got.append([int(s[0]) for s in epoch.__next__()])
                except KeyError as error:
                    errors.append((str(error), len(got)))
                except StopIteration:
                    break
            assert sorted(message for message, _ in errors) == ["'record 300 is damaged'",
                                                                 "'record 7 is damaged'"]
            assert sorted(batch[0] // 10 for batch in got) == [i for i in range(100) if i not in (0, 30)]
            assert all(batch == list(range(batch[0], batch[0] + 10)) for batch in got)
            if in_order:
                assert [position for _, position in errors] == [0, 29]  # in their places


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_http_error_arrives_as_its_own_type_with_its_status(method):
    # urllib's HTTPError cannot be rebuilt by a plain pickle, and aiohttp's ClientResponseError
    # holds headers that do not pickle: both arrived as CallbackError, so `except HTTPError as e:
    # e.code` never matched.
    import urllib.error

    from sources import http_404_urllib

    with ParallelSource(http_404_urllib, 2, start_method=method) as src:
        with pytest.raises(urllib.error.HTTPError) as caught:
            next(iter(src))
    assert caught.value.code == 404 and caught.value.url == "http://store/0"
    assert "HTTP Error 404: Not Found" in str(caught.value)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_aiohttp_response_error_arrives_with_its_status_and_request(method):
    aiohttp = pytest.importorskip("aiohttp")
    from sources import http_404_aiohttp

    with ParallelSource(http_404_aiohttp, 2, start_method=method) as src:
        with pytest.raises(aiohttp.ClientResponseError) as caught:
            next(iter(src))
    error = caught.value
    assert error.status == 404 and str(error.request_info.real_url) == "http://store/0"
    assert error.request_info.headers["Accept"] == "*/*"  # a plain dict now: the values travel


def test_an_error_after_the_end_of_epoch_is_not_raised():
    def source(info):
        if info.idx_in_epoch == 5:
            raise StopIteration
        if info.idx_in_epoch > 5:
            raise RuntimeError("past the end")
        return np.array([info.idx_in_epoch])

    with ParallelSource(source, 8, num_workers=2, last_batch="partial") as src:
        assert [len(b) for b in src] == [5]


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, "expected a NumPy array of numbers, got None"),
        ("text", "got str 'text'"),
        ([object(), object()], "dtype object"),
        (b"\x00\x01", "np.frombuffer"),
        ((np.zeros(2), np.zeros(2)), "num_outputs=2"),
    ],
)
def test_invalid_samples_name_the_sample_and_output(value, expected):
    def source(info):
        return value if info.idx_in_epoch == 3 else np.zeros(2)

    with ParallelSource(source, 4, num_workers=2) as src:
        with pytest.raises(SampleError) as caught:
            next(iter(src))
    message = str(caught.value)
    assert expected in message
    assert "idx_in_epoch=3" in message and "output 0" in message


def test_wrong_number_of_outputs():
    def source(info):
        return (np.zeros(1),) * (3 if info.idx_in_epoch == 1 else 2)

    with ParallelSource(source, 2, num_outputs=2) as src:
        with pytest.raises(SampleError, match=r"expected a tuple of 2 outputs .* got a tuple of 3"):
            next(iter(src))


def test_declared_dtype_and_ndim_are_enforced():
    def source(info):
        return np.zeros((2, 2), np.float64 if info.idx_in_epoch == 2 else np.float32)

    with ParallelSource(source, 4, dtype=np.float32) as src:
        with pytest.raises(SampleError, match="expected dtype float32 .* got float64"):
            next(iter(src))
    with ParallelSource(lambda info: np.zeros((2, 2), np.float32), 4, ndim=3) as src:
        with pytest.raises(SampleError, match="expected 3 dimensions"):
            next(iter(src))


def test_ndim_changing_within_a_batch_is_an_error():
    def source(info):
        return np.zeros((2,) * (2 if info.idx_in_batch == 5 else 1), np.uint8)

    with ParallelSource(source, 8, num_workers=2) as src:
        with pytest.raises(SampleError, match="idx_in_batch=5.*share dtype and number of dimensions"):
            next(iter(src))


def test_killed_worker_is_reported_with_signal_and_samples():
    def source(info):
        if info.idx_in_epoch == 9:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.array([info.idx_in_epoch])

    src = ParallelSource(source, 8, num_workers=2)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError) as caught:
        list(src)
    assert time.monotonic() - started < HANG_GUARD_S  # reported, not hung
    message = str(caught.value)
    assert "SIGKILL" in message and "idx_in_epoch 8..15" in message
    with pytest.raises(PoolClosedError, match="SIGKILL"):
        list(src)
    src.close()


def test_exit_code_of_a_worker_that_exits():
    def source(info):
        os._exit(7)

    with ParallelSource(source, 2) as src:
        with pytest.raises(WorkerDiedError, match="exited with code 7"):
            next(iter(src))


def test_timeout_names_the_stuck_samples():
    def source(info):
        if info.idx_in_epoch == 6:
            time.sleep(60)
        return np.array([info.idx_in_epoch])

    src = ParallelSource(source, 4, num_workers=2, timeout=1.0)
    it = iter(src)
    next(it)
    started = time.monotonic()
    with pytest.raises(SourceTimeoutError, match=r"timeout=1.0 s.*samples 0..3 of batch 1.*idx_in_epoch 4..7"):
        next(it)
    assert time.monotonic() - started < HANG_GUARD_S  # reported, not hung
    src.close()


class CustomBase(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


def raises_base_exceptions(info):
    if info.idx_in_epoch == 5:
        raise SystemExit(3)
    if info.idx_in_epoch == 13:
        raise KeyboardInterrupt("raised by the callback")
    if info.idx_in_epoch == 21:
        raise CustomBase("custom")
    return np.array([info.idx_in_epoch])


@pytest.mark.parametrize("at, kind, text", [
    (0, SystemExit, "3"),
    (8, KeyboardInterrupt, "raised by the callback"),
    (16, CustomBase, "custom"),
])
def test_a_base_exception_in_the_callback_reaches_the_consumer_like_any_other(at, kind, text):
    with ParallelSource(raises_base_exceptions, 4, num_workers=2) as src:
        src.set_state({"epoch_idx": 0, "iteration": at // 4})
        it = iter(src)
        next(it)  # the batch before the failing one
        with pytest.raises(kind) as caught:
            next(it)
        assert str(caught.value) == text
        cause = caught.value.__cause__
        assert isinstance(cause, WorkerTraceback)
        assert f"idx_in_epoch={at + 5}" in str(cause) and "raises_base_exceptions" in cause.text
        pids = src.worker_pids()
        src.set_state({"epoch_idx": 0, "iteration": 0})
        assert int(next(iter(src))[0][0]) == 0  # the workers lived through it
        assert src.worker_pids() == pids


@pytest.mark.parametrize("length", [1, 1 << 18])  # written at the task's end, or one by one
def test_a_failure_while_writing_a_sample_says_where_with_the_worker_traceback(monkeypatch, length):
    # An error that is neither the callback's nor one of extsrc's own (here: writing a spilled
    # sample fails) must still say where it happened, not arrive bare.
    from extsrc.shm import writer

    def broken_put(self, array):
        raise OSError("the overflow segment could not be written")

    monkeypatch.setattr(writer.OverflowArea, "put", broken_put)
    with ParallelSource(lambda info: np.zeros(length + info.idx_in_epoch % 3), 4, num_workers=1,
                        start_method="fork") as src:
        with pytest.raises(OSError, match="could not be written") as caught:
            next(iter(src))
    cause = caught.value.__cause__
    assert isinstance(cause, WorkerTraceback)
    assert "broken_put" in cause.text and "while checking or writing" in cause.text
    assert "raised by the callback" not in cause.text
    assert any("extsrc worker 0" in note and "idx_in_epoch=0" in note
               for note in caught.value.__notes__)


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_an_exception_class_of_the_main_script_arrives_with_its_type(method):
    # Under spawn the worker rebuilds the class by value with the callback; the consumer still
    # catches the main script's own class, with its attributes and the worker traceback.
    out = run_isolated(
        f"""
        import numpy as np
        import extsrc

        class BadRecord(ValueError):
            def __init__(self, record, why):
                super().__init__(record, why)
                self.record = record

        def load(info):
            if info.idx_in_epoch == 5:
                raise BadRecord(info.idx_in_epoch, "corrupt")
            return np.zeros(3)

        if __name__ == "__main__":
            with extsrc.ParallelSource(load, 4, num_workers=2, start_method="{method}") as src:
                try:
                    list(src)
                except BadRecord as exc:
                    print("CAUGHT", type(exc) is BadRecord, exc.record, exc.args,
                          "raise BadRecord" in str(exc.__cause__))
                except Exception as exc:
                    print("OTHER", type(exc).__name__, exc)
        """
    )
    assert "CAUGHT True 5 (5, 'corrupt') True" in out.stdout, out.stdout + out.stderr[-2000:]


def test_an_exception_the_consumer_cannot_rebuild_arrives_as_callback_error_with_its_text():
    out = run_isolated(
        """
        import numpy as np
        import extsrc

        def load(info):
            class Local(Exception):  # no name the consumer can find
                pass
            if info.idx_in_epoch == 5:
                raise Local("record 5 is corrupt")
            return np.zeros(3)

        if __name__ == "__main__":
            with extsrc.ParallelSource(load, 4, num_workers=2, start_method="spawn") as src:
                try:
                    list(src)
                except extsrc.CallbackError as exc:
                    print("CALLBACK", exc)
        """
    )
    assert "CALLBACK load.<locals>.Local: record 5 is corrupt" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_worker_that_dies_between_epochs_is_raised_as_itself_by_the_next_epoch():
    src = ParallelSource(StopsAt(8), 4, num_workers=2)
    assert len(list(src)) == 2  # the epoch ended; the workers wait for the next one
    os.kill(src.worker_pids()[0], signal.SIGKILL)
    deadline = time.monotonic() + HANG_GUARD_S
    while src.worker_pids() and time.monotonic() < deadline:  # the pool notices and stops
        time.sleep(0.05)
    with pytest.raises(WorkerDiedError, match="SIGKILL"):
        list(src)
    with pytest.raises(PoolClosedError, match="SIGKILL"):
        list(src)
    src.close()
