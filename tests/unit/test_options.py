"""Unit tests: arguments are checked once, with messages that say what was expected."""

import numpy as np
import pytest

from extsrc import ParallelSource, WorkerPool
from extsrc.options import PoolOptions, SourceOptions


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
    ({"batch_size": 4, "batch_info": True}, "batch_info=True needs batch=True"),
])
def test_bad_source_options_say_what_was_expected(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", "\\(").replace(")", "\\)")):
        SourceOptions.create(**kwargs)


def test_an_object_dtype_is_refused():
    with pytest.raises(TypeError, match="numeric or bool dtype, got object"):
        SourceOptions.create(4, dtype=object)


def test_prefetch_defaults_to_two_batches_per_worker():
    assert SourceOptions.create(4, num_workers=3).prefetch == 6
    assert SourceOptions.create(4, prefetch=1, num_workers=3).prefetch == 1


@pytest.mark.parametrize("kwargs", [{"num_workers": True}, {"num_workers": 0}, {"start_method": "thread"}])
def test_bad_pool_options_are_refused(kwargs):
    with pytest.raises(ValueError):
        PoolOptions.create(**kwargs)


@pytest.mark.parametrize("given", [{"num_workers": 1}, {"start_method": "fork"}, {"pickler": None}])
def test_pool_settings_given_with_a_shared_pool_are_an_error_even_at_their_defaults(given):
    pool = WorkerPool(2)
    with pytest.raises(ValueError, match="come\\(s\\) from the shared pool \\(num_workers=2"):
        ParallelSource(lambda info: np.zeros(1), 4, pool=pool, **given)
    pool.close()
