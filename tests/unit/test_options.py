"""Unit tests: arguments are checked once, where they are defined, with messages that say what
was expected."""

import numpy as np
import pytest

from extsrc import Hooks, Order, ParallelSource, PoolSpec, WorkerPool
from extsrc.engine import SourceSpec


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, "batch_size must be a positive int, got 0"),
    ({"batch_size": True}, "batch_size must be a positive int, got True"),
    ({"batch_size": 4, "prefetch": 2.0}, "prefetch must be a positive int, got 2.0"),
    ({"batch_size": 4, "num_outputs": False}, "num_outputs must be a positive int, got False"),
    ({"batch_size": 4, "last_batch": "keep"}, "last_batch must be one of"),
    ({"batch_size": 4, "timeout": 0}, "timeout must be None or a positive number"),
    ({"batch_size": 4, "timeout": True}, "timeout must be None or a positive number"),
    ({"batch_size": 4, "num_outputs": 2, "dtype": [np.uint8]}, "dtype has 1 entries for 2 outputs"),
    ({"batch_size": 4, "ndim": -1}, "ndim of output 0: expected None or an int >= 0"),
    ({"batch_size": 4, "hooks": Hooks(batch_info=True)}, "hooks.batch_info=True needs batch=True"),
    ({"batch_size": 4, "hooks": {"batch_info": True}}, "hooks must be an extsrc.Hooks, got dict"),
    ({"batch_size": 4, "stats": "often"}, "stats must be True, False or a positive number"),
])
def test_bad_source_options_say_what_was_expected(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", "\\(").replace(")", "\\)")):
        SourceSpec(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"worker_init": "setup"}, "hooks.worker_init must be a callable or None, got str"),
    ({"assign": 3}, "hooks.assign must be a callable or None, got int"),
    ({"batch_info": 1}, "hooks.batch_info must be True or False, got 1"),
])
def test_bad_hooks_say_what_was_expected(kwargs, message):
    with pytest.raises(TypeError, match=message):
        Hooks(**kwargs)


def test_an_object_dtype_is_refused():
    with pytest.raises(TypeError, match="numeric or bool dtype, got object"):
        SourceSpec(4, dtype=object)


def test_a_source_has_at_most_twenty_three_keyword_arguments():
    # What one layer needs is a hook (Hooks), not an argument. The last two in, on_error and
    # max_errors, are what the user decides about bad data, under the same names in every API;
    # worker_restarts joins the pool's own (num_workers, start_method, pickler, backend).
    import inspect

    keywords = [p for p in inspect.signature(ParallelSource).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(keywords) <= 23, [p.name for p in keywords]


def test_prefetch_defaults_to_two_batches_per_worker():
    with ParallelSource(lambda info: np.zeros(1), 4, num_workers=3) as src:
        assert src.prefetch == 6
    with ParallelSource(lambda info: np.zeros(1), 4, num_workers=3, prefetch=1) as src:
        assert src.prefetch == 1


@pytest.mark.parametrize("kwargs", [{"num_workers": True}, {"num_workers": 0}, {"start_method": "thread"}])
def test_bad_pool_options_are_refused(kwargs):
    with pytest.raises(ValueError):
        PoolSpec(**kwargs)


@pytest.mark.parametrize("given", [{"num_workers": 1}, {"start_method": "fork"}])
@pytest.mark.parametrize("shared", [True, False])
def test_pool_settings_given_beside_a_pool_are_an_error_even_at_their_defaults(given, shared):
    pool = WorkerPool(2) if shared else PoolSpec(num_workers=2)
    with pytest.raises(ValueError, match="come\\(s\\) from pool= \\(num_workers=2"):
        ParallelSource(lambda info: np.zeros(1), 4, pool=pool, **given)
    if shared:
        pool.close()


def _record(info):
    return np.full(2, info.record)


def test_a_pool_spec_makes_a_pool_the_source_runs_on_and_closes():
    spec = PoolSpec(num_workers=2, start_method="spawn", worker_restarts=1)
    with ParallelSource(_record, 4, pool=spec, order=Order(8)) as src:
        assert [int(sample[0]) for batch in src for sample in batch] == list(range(8))
        pool = src.pool
        assert (pool.num_workers, pool.start_method, pool.spec.worker_restarts) == (2, "spawn", 1)
    assert pool.closed


def test_a_pool_that_is_neither_a_pool_nor_a_spec_is_refused():
    with pytest.raises(TypeError, match="pool must be an extsrc.WorkerPool or an extsrc.PoolSpec, got dict"):
        ParallelSource(np.zeros, 4, pool={"num_workers": 2})
