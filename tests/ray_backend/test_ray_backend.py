"""backend="ray": the same batches, guarantees and errors as worker processes, from Ray actors.

Every test compares with what the process backend gives, or with what a user
of it relies on. One local Ray of 2 CPUs serves them all (``local_ray``).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from extsrc import (
    Hooks, Order, ParallelSource, PoolClosedError, PoolSpec, SampleError, WorkerPool,
)
from extsrc.shm.slots import lease_of

from faultkit import HANG_GUARD_S

from sources import (
    ReusesItsBatch, ReusesItsBuffers, StopsAt, filling_two_outputs, jittered, large_sample, records_and_draws,
    sample_of, two_outputs, varying_sizes, with_empty_samples,
)

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("local_ray")]


@pytest.fixture(params=["same-node", "same-node-calls", "other-node"])
def actor_path(request, monkeypatch):
    """Each data test runs every way tasks and samples travel: actors on the consumer's node
    served over a Unix socket (the default) or in Ray calls, writing into the slots
    themselves, and actors that return samples through Ray as on other nodes (forced here on
    one node)."""
    import extsrc.ray.backend

    monkeypatch.setattr(extsrc.ray.backend, "LOCAL_WRITES", request.param != "other-node")
    monkeypatch.setattr(extsrc.ray.backend, "DIRECT_CHANNEL", request.param == "same-node")
    return request.param


def epochs(epoch_count=2, batches=None, **kwargs):
    """Every batch of ``epoch_count`` epochs, copied: a tuple of outputs as arrays or lists."""
    out = []
    with ParallelSource(**kwargs) as src:
        for _ in range(epoch_count):
            it = iter(src)
            taken = []
            for k, batch in enumerate(it):
                taken.append(_copy(batch))
                if batches is not None and k + 1 == batches:
                    break
            out.append(taken)
    return out


def _copy(batch):
    outputs = batch if isinstance(batch, tuple) else (batch,)
    return tuple((o.is_dense, [np.array(s) for s in o]) for o in outputs)


def assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for e, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a) == len(b), f"epoch {e}: {len(a)} batches, processes gave {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert len(x) == len(y)
            for (dense_x, xs), (dense_y, ys) in zip(x, y):
                assert dense_x == dense_y, f"epoch {e}, batch {i}: dense {dense_x} vs {dense_y}"
                assert len(xs) == len(ys)
                for s, t in zip(xs, ys):
                    assert s.dtype == t.dtype and s.shape == t.shape
                    np.testing.assert_array_equal(s, t, err_msg=f"epoch {e}, batch {i}")


def both(**kwargs):
    """(ray, processes) results of the same source."""
    return (epochs(pool=PoolSpec(backend="ray", num_workers=2), **kwargs),
            epochs(num_workers=2, start_method="fork", **kwargs))


@pytest.mark.parametrize("sample_bytes", [64, 256 << 10])
def test_actors_on_the_consumers_node_write_the_slots_themselves_others_through_ray(actor_path, sample_bytes):
    with ParallelSource(ReusesItsBuffers(16, sample_bytes, False), 16, pool=PoolSpec(backend="ray", num_workers=2)) as src:
        taken = [_copy(batch) for _, batch in zip(range(6), src)]
        actors = src.pool.workers_backend.actors()
    with ParallelSource(ReusesItsBuffers(16, sample_bytes, False), 16, num_workers=2) as src:
        expected = [_copy(batch) for _, batch in zip(range(6), src)]
    assert_same([taken], [expected])
    delivered = sum(a.samples for a in actors)
    direct = sum(a.direct_samples for a in actors)
    assert delivered >= 6 * 16
    assert direct == (delivered if actor_path != "other-node" else 0), [tuple(a) for a in actors]
    assert all(a.channel == (actor_path == "same-node") for a in actors), [tuple(a) for a in actors]


def test_actors_that_cannot_reach_the_pools_socket_go_on_with_ray_calls(monkeypatch):
    import extsrc.ray.backend

    listen = extsrc.ray.backend.RayBackend._listen

    def listen_elsewhere(self):
        listen(self)
        self._address = "\0extsrc-test-nobody-listens-here"  # the actors' connect() fails

    monkeypatch.setattr(extsrc.ray.backend.RayBackend, "_listen", listen_elsewhere)
    with ParallelSource(sample_of, 8, pool=PoolSpec(backend="ray", num_workers=2)) as src:
        taken = [_copy(batch) for _, batch in zip(range(5), src)]
        actors = src.pool.workers_backend.actors()
    with ParallelSource(sample_of, 8, num_workers=2) as src:
        expected = [_copy(batch) for _, batch in zip(range(5), src)]
    assert_same([taken], [expected])
    assert not any(a.channel for a in actors)
    assert sum(a.direct_samples for a in actors) == sum(a.samples for a in actors) >= 5 * 8


def _big_endian(info):
    return (np.arange(3) + info.idx_in_epoch).astype(">f8")


def test_a_big_endian_output_stays_big_endian_in_every_batch(actor_path):
    with ParallelSource(_big_endian, 4, pool=PoolSpec(backend="ray", num_workers=2)) as src:
        for iteration, batch in zip(range(5), src):
            for k, sample in enumerate(batch):
                assert sample.dtype.str == ">f8", f"batch {iteration}, sample {k}"
                first = iteration * 4 + k
                assert sample.tolist() == [first, first + 1, first + 2]


def test_sample_mode_gives_the_batches_processes_give_despite_jitter(actor_path):
    ours, theirs = both(source=jittered, batch_size=6, batches=7)
    assert_same(ours, theirs)
    assert all(dense for epoch in ours for batch in epoch for dense, _ in batch[1:])


def test_large_samples_written_one_by_one_are_the_same(actor_path):
    ours, theirs = both(source=large_sample, batch_size=4, batches=3, epoch_count=1)
    assert_same(ours, theirs)
    assert ours[0][0][0][0], "a batch of same-shaped large samples is one dense array"


@pytest.mark.parametrize("sample_bytes, ragged", [
    (16, True),  # small samples of varying shape: they travel as they are, not stacked
    (16 << 10, False),  # 2 MiB per batch of 16: the actor puts them into the object store
])
def test_a_callback_that_reuses_its_buffers_gives_the_batches_processes_give(sample_bytes, ragged, actor_path):
    # The actor runs the next task while the last answer waits to be sent: it must not send
    # memory the callback overwrites meanwhile.
    ours, theirs = both(source=ReusesItsBuffers(16, sample_bytes, ragged), batch_size=16, batches=12,
                        epoch_count=1)
    assert_same(ours, theirs)


@pytest.mark.parametrize("sample_bytes", [64, 128 << 10])  # 1 KiB or 2 MiB per batch of 16
def test_a_batch_callback_that_refills_one_array_gives_the_batches_processes_give(sample_bytes, actor_path):
    ours, theirs = both(source=ReusesItsBatch(16, sample_bytes, 10), batch_size=16, batch=True,
                        hooks=Hooks(batch_info=True), epoch_count=1)
    assert_same(ours, theirs)
    assert [int(batch[0][1][0][0]) for batch in ours[0]] == list(range(10))


def test_sizes_that_jump_between_batches_and_empty_samples_give_what_processes_give(actor_path):
    # Tiny batches then MiB ones and back: answers outgrow what the pool expected of them.
    ours, theirs = both(source=varying_sizes, batch_size=6, num_outputs=3, batches=16, epoch_count=1)
    assert_same(ours, theirs)
    ours, theirs = both(source=with_empty_samples, batch_size=4, num_outputs=2, batches=4, epoch_count=1)
    assert_same(ours, theirs)


def test_in_place_callbacks_give_what_processes_give(actor_path):
    ours, theirs = both(source=filling_two_outputs, batch_size=5, num_outputs=2, in_place=True,
                        batches=3, epoch_count=1)
    assert_same(ours, theirs)
    copied, _ = both(source=two_outputs, batch_size=5, num_outputs=2, batches=3, epoch_count=1)
    assert_same(ours, copied)


def test_statistics_count_what_the_actors_delivered():
    with ParallelSource(sample_of, 6, pool=PoolSpec(num_workers=2, backend="ray")) as src:
        it = iter(src)
        for _ in range(5):
            next(it)
        stats = src.stats()
    assert (stats.batches, stats.samples) == (5, 30)
    assert stats.bytes == 30 * 4 * 8  # sample_of: four int64 per sample
    assert len(stats.worker_busy) == 2 and max(stats.worker_busy) > 0
    assert stats.callback_median_s is not None and stats.callback_median_s >= 0


def test_several_outputs_dense_and_ragged_are_the_same(actor_path):
    ours, theirs = both(source=two_outputs, batch_size=5, num_outputs=2, batches=4)
    assert_same(ours, theirs)
    images, ragged = ours[0][2]
    assert images[0] and not ragged[0]  # the image output is one array, the ragged one a list
    assert [r.shape for r in ragged[1]] == [(k + 1,) for k in range(5)]


@pytest.mark.parametrize("last_batch", ["drop", "partial"])
def test_the_epoch_ends_where_the_callback_stops_with_either_policy(last_batch):
    ours, theirs = both(source=StopsAt(23), batch_size=4, last_batch=last_batch)
    assert_same(ours, theirs)
    sizes = [len(batch[0][1]) for batch in ours[0]]
    assert sizes == ([4] * 5 + ([3] if last_batch == "partial" else []))


def _batch_of(info):
    if info.iteration >= 5:
        raise StopIteration
    return [np.full((info.iteration + 2,), info.epoch_idx * 100 + info.iteration, np.int16)] * 3


def _generator():
    for k in range(4):
        yield np.arange(6, dtype=np.float32).reshape(3, 2) + k  # 3 samples along axis 0


@pytest.mark.parametrize("source, kwargs", [(_batch_of, {"hooks": Hooks(batch_info=True)}), (_generator, {})],
                         ids=["callable", "generator"])
def test_batch_mode_callables_and_generators_give_the_same_batches(source, kwargs):
    ours, theirs = both(source=source, batch_size=4, batch=True, **kwargs)
    assert_same(ours, theirs)
    assert len(ours[0]) == (5 if source is _batch_of else 4)


def test_an_order_with_padding_shards_and_resume_give_the_same_records_and_draws():
    order = Order(50, shuffle=True, seed=3, shard=(1, 2), remainder="pad")
    kwargs = dict(source=records_and_draws, batch_size=4, order=order, last_batch="pad")
    ours, theirs = both(**kwargs)
    assert_same(ours, theirs)
    with ParallelSource(pool=PoolSpec(backend="ray", num_workers=2), **kwargs) as src:
        it = iter(src)
        for _ in range(3):
            next(it)
        state = src.get_state()
    with ParallelSource(pool=PoolSpec(backend="ray", num_workers=2), **kwargs) as resumed:
        resumed.set_state(state)
        rest = [_copy(b) for b in iter(resumed)]
    assert_same([rest], [ours[0][3:]])


def test_batches_are_zero_copy_and_stay_right_for_as_long_as_they_are_held(actor_path):
    def sample(info):
        return np.full((256,), info.idx_in_epoch % 251, np.uint8)

    with ParallelSource(sample, 8, pool=PoolSpec(backend="ray", num_workers=2)) as src:
        kept = []
        it = iter(src)
        for _ in range(30):
            kept.append(next(it))
        dense = kept[-1].as_array()
        assert lease_of(dense) is not None  # a view of the slot, not a copy
        assert all(np.shares_memory(dense, s) for s in kept[-1])
        for _ in range(40):  # the slots go round many times while the kept batches are held
            next(it)
    for i, batch in enumerate(kept):  # also after close()
        assert batch.as_array()[:, 0].tolist() == [(i * 8 + k) % 251 for k in range(8)]


def _extsrc_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum("extsrc:" in line for line in maps)


def test_close_kills_every_actor_and_frees_the_shared_memory():
    import ray

    before = _extsrc_mappings()
    gc.disable()
    try:
        src = ParallelSource(lambda info: np.ones(1 << 16, np.uint8), 8, pool=PoolSpec(backend="ray", num_workers=2))
        it = iter(src)
        for _ in range(5):
            next(it)
        deadline = time.monotonic() + 30
        while len(src.worker_pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        pids = src.worker_pids()
        assert len(pids) == 2 and _extsrc_mappings() > before
        src.close()
        assert [p for p in pids if _running(p)] == []
        assert _extsrc_mappings() == before  # also the pool's own mappings, for the actors
        assert src.worker_pids() == []
    finally:
        gc.enable()
    deadline = time.monotonic() + 5  # Ray's resource view follows within its report period
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.available_resources().get("CPU", 0) == 2
    with pytest.raises(PoolClosedError):
        iter(src)


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _raises_at_13(info):
    if info.idx_in_epoch == 13:
        raise FileNotFoundError(f"/data/img_{info.idx_in_epoch}.jpg")
    return np.zeros(2, np.int32)


def test_a_callback_exception_keeps_its_type_traceback_and_sample_and_the_actor_goes_on():
    with ParallelSource(_raises_at_13, 8, pool=PoolSpec(backend="ray", num_workers=2)) as src:
        it = iter(src)
        next(it)
        with pytest.raises(FileNotFoundError, match="img_13.jpg") as caught:
            next(it)
        cause = str(caught.value.__cause__)
        assert "idx_in_epoch=13, idx_in_batch=5, iteration=1, epoch_idx=0" in cause
        assert "_raises_at_13" in cause and 'raise FileNotFoundError(f"/data/img_' in cause
        assert "extsrc worker" in cause
        assert len(next(iter(src))) == 8  # the next epoch runs on the same actors


def test_a_bad_sample_is_named_as_with_processes():
    def bad(info):
        return np.zeros(3, np.float64) if info.idx_in_epoch == 5 else np.zeros(3, np.uint8)

    messages = []
    for backend in ("ray", "processes"):
        with ParallelSource(bad, 4, pool=PoolSpec(num_workers=2, backend=backend), dtype=np.uint8) as src:
            it = iter(src)
            next(it)
            with pytest.raises(SampleError) as caught:
                next(it)
            messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert "idx_in_epoch=5" in messages[0] and "expected dtype uint8" in messages[0]


def test_a_shared_pool_serves_two_sources_and_owns_its_settings():
    pool = WorkerPool(2, backend="ray")
    try:
        a = ParallelSource(sample_of, 4, pool=pool)
        b = ParallelSource(lambda info: np.full(2, -info.idx_in_epoch, np.int64), 3, pool=pool)
        with pytest.raises(ValueError, match="backend='ray'"):
            ParallelSource(sample_of, 4, pool=pool, num_workers=2)
        first_a, first_b = next(iter(a)), next(iter(b))
        assert first_a.as_array()[:, 0].tolist() == [0, 1, 2, 3]
        assert first_b.as_array()[:, 1].tolist() == [0, -1, -2]
        assert pool.backend == "ray" and pool.start_method is None
    finally:
        pool.close()


def test_a_timeout_names_the_stuck_actor_and_the_samples():
    def slow(info):
        if info.idx_in_epoch == 10:
            time.sleep(60)
        return np.zeros(1)

    # The actors run before the timed source starts (a source without a timeout waits for
    # them): on a loaded machine they may take longer than the timeout to come up.
    pool = WorkerPool(2, backend="ray")
    warm = ParallelSource(sample_of, 4, pool=pool)
    src = ParallelSource(slow, 4, pool=pool, timeout=5)
    next(iter(warm))
    it = iter(src)
    next(it)
    started = time.monotonic()
    from extsrc import SourceTimeoutError

    with pytest.raises(SourceTimeoutError, match=r"timeout=5 s\. Stuck: worker \d \(Ray actor pid \d+ on node [\d.]+ \(.+\)\): samples 0\.\.3 of batch 2"):
        for _ in range(3):
            next(it)
    assert time.monotonic() - started < HANG_GUARD_S  # reported, not hung
    pool.close()


def test_a_timeout_says_an_actor_never_started_and_what_it_asked_for():
    src = ParallelSource(sample_of, 4, pool=WorkerPool(1, backend="ray", ray_options={"num_cpus": 3}),
                         timeout=3)
    from extsrc import SourceTimeoutError

    with pytest.raises(SourceTimeoutError) as caught:
        next(iter(src))
    src.close()
    message = str(caught.value)
    assert "a Ray actor not running yet" in message and "num_cpus=3" in message
    assert "CPU free" in message and "samples 0..3 of batch 0" in message


def test_importing_extsrc_and_running_processes_does_not_import_ray():
    code = ("import sys, numpy as np, extsrc, extsrc.ray\n"
            "with extsrc.ParallelSource(lambda i: np.zeros(1), 2) as s: next(iter(s))\n"
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def _marked(info):
    return np.frombuffer(os.environ.get("EXTSRC_TEST_MARK", "-").encode(), np.uint8)


def test_ray_options_reach_the_actors_and_ray_refuses_bad_ones_at_once():
    from extsrc.ray import RayBackend

    pool = WorkerPool(2, backend="ray", ray_options={
        "num_cpus": 0.5, "runtime_env": {"env_vars": {"EXTSRC_TEST_MARK": "actor"}}})
    assert isinstance(pool.workers_backend, RayBackend) and pool.max_outstanding == RayBackend.max_outstanding
    with ParallelSource(_marked, 2, pool=pool) as src:
        assert bytes(next(iter(src)).as_array()[0]) == b"actor"
    pool.close()
    with pytest.raises(ValueError, match="Ray refused them: .*num_cpus"):
        WorkerPool(2, backend="ray", ray_options={"resources": {"CPU": 2}})


def _by_position(info):
    return np.array([info.idx_in_epoch], np.int64)


def test_reading_idx_in_epoch_under_a_shuffled_order_is_warned_once_with_ray_actors():
    import warnings

    from extsrc import OrderWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ParallelSource(_by_position, 8, pool=PoolSpec(backend="ray", num_workers=2),
                            order=Order(32, shuffle=True)) as src:
            for _ in src:
                pass
    notes = [w for w in caught if issubclass(w.category, OrderWarning)]
    assert len(notes) == 1 and "idx_in_epoch" in str(notes[0].message)


class _Planted:
    """Unpickled, it would leave a file: what another local process could send the pool."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pool_sockets():
    """The abstract socket names the pools of this process listen on (from /proc/net/unix:
    the connections accepted on one carry its name too; a listening socket's flags say so)."""
    mine = f"@extsrc-ray-{os.getpid()}-"
    listening = "00010000"  # __SO_ACCEPTCON
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f]
    return [row[-1] for row in rows if len(row) == 8 and row[-1].startswith(mine) and row[3] == listening]


def test_another_process_connecting_to_the_pools_socket_is_ignored_and_nothing_it_sends_is_unpickled(tmp_path):
    import socket
    import struct

    from extsrc.engine.channel import Channel

    planted = tmp_path / "planted"
    with ParallelSource(sample_of, 8, pool=PoolSpec(backend="ray", num_workers=2)) as src:
        it = iter(src)
        first = [np.array(s) for s in next(it)]
        (address,) = _pool_sockets()
        intruders = []
        for prefix in (b"", b"\0" * 16 + struct.pack("<I", 0)):  # a message at once; a wrong token
            intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            intruder.connect("\0" + address[1:])
            try:
                intruder.sendall(prefix)
                Channel(intruder, pool_end=False).send(_Planted(str(planted)))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the pool hung up on it before it had sent everything: as it should
            intruders.append(intruder)
        rest = [[np.array(s) for s in b] for _, b in zip(range(30), it)]
        assert all(a.channel for a in src.pool.workers_backend.actors())  # they connected meanwhile
        for intruder in intruders:
            intruder.close()
    assert not planted.exists()
    with ParallelSource(sample_of, 8, num_workers=2) as src:
        expected = [[np.array(s) for s in b] for _, b in zip(range(31), src)]
    for got, want in zip([first] + rest, expected):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_a_replacing_on_error_gives_its_samples_and_faults_every_way(actor_path):
    from sources import FailsOn, minus_record

    with ParallelSource(FailsOn(32, (5, 20)), 8, pool=PoolSpec(num_workers=2, backend="ray"),
                        on_error=minus_record) as source:
        records = [int(sample[0]) for batch in source for sample in batch]
        assert records == [-r if r in (5, 20) else r for r in range(32)]
        assert [(f.record, f.replaced) for f in source.faults()] == [(5, True), (20, True)]


def test_skipping_needs_worker_processes():
    from sources import FailsOn

    with pytest.raises(ValueError, match="on_error='skip' needs backend='processes'"):
        ParallelSource(FailsOn(32, ()), 8, pool=PoolSpec(num_workers=2, backend="ray"), on_error="skip")
