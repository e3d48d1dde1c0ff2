"""Unit tests: the backend arguments are checked once, before Ray is imported or started."""

import subprocess
import sys

import numpy as np
import pytest

from extsrc import ParallelSource, WorkerPool
from extsrc.engine import PoolSpec


def pool_spec(num_workers=1, ray_options=None, **kwargs):
    """The spec a WorkerPool(num_workers, ray_options=..., **kwargs) checks."""
    return PoolSpec(num_workers, backend_options=ray_options, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"backend": "threads"}, "backend must be one of ('processes', 'ray'), got 'threads'"),
    ({"backend": "ray", "start_method": "spawn"}, "start_method='spawn' chooses how worker processes"),
    ({"ray_options": {"num_cpus": 1}}, "ray_options is for backend='ray', got it with backend='processes'"),
    ({"backend": "ray", "ray_options": [("num_cpus", 1)]}, "ray_options must be a dict of Ray actor options"),
    ({"backend": "ray", "ray_options": {"num_cpu": 1}}, "ray_options['num_cpu']: not an option extsrc passes"),
    ({"backend": "ray", "ray_options": {"max_restarts": 2}},
     "ray_options['max_restarts']: extsrc sets this Ray option itself (a restarted actor"),
    ({"backend": "ray", "ray_options": {"max_concurrency": 4}}, "one at a time, in the order sent"),
    ({"backend": "ray", "ray_options": {"num_cpus": -1}}, "ray_options['num_cpus'] must be a number >= 0"),
    ({"backend": "ray", "ray_options": {"num_cpus": True}}, "ray_options['num_cpus'] must be a number >= 0"),
    ({"backend": "ray", "ray_options": {"resources": {"ssd": "1"}}},
     "ray_options['resources']['ssd'] must be a number >= 0, got '1'"),
    ({"backend": "ray", "ray_options": {"runtime_env": "pip"}}, "ray_options['runtime_env'] must be a dict"),
    ({"backend": "ray", "ray_options": {"scheduling_strategy": "EVERYWHERE"}},
     "ray_options['scheduling_strategy'] must be one of ('DEFAULT', 'SPREAD') or a Ray scheduling"),
])
def test_bad_backend_arguments_say_what_was_expected(kwargs, message):
    with pytest.raises((ValueError, TypeError)) as caught:
        pool_spec(**kwargs)
    assert message in str(caught.value)


def test_good_ray_options_are_kept_as_given_and_processes_keep_fork_by_default():
    options = pool_spec(3, backend="ray", ray_options={"num_cpus": 0.5, "resources": {"ssd": 1}})
    assert (options.backend, options.start_method, options.num_workers) == ("ray", None, 3)
    assert options.backend_options == {"num_cpus": 0.5, "resources": {"ssd": 1}}
    assert PoolSpec().start_method == "fork" and PoolSpec().backend == "processes"


def test_a_bad_backend_given_to_a_source_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="backend must be one of"):
        ParallelSource(lambda info: np.zeros(1), 2, pool=PoolSpec(backend="Ray"))
    with pytest.raises(ValueError, match="start_method='fork' chooses"):
        ParallelSource(lambda info: np.zeros(1), 2, pool=PoolSpec(backend="ray", start_method="fork"))


def test_a_process_pool_refuses_backend_settings_given_again_to_its_source():
    pool = WorkerPool(2)
    try:
        with pytest.raises(ValueError, match="start_method come\\(s\\) from pool= .*backend='processes'"):
            ParallelSource(lambda info: np.zeros(1), 2, pool=pool, start_method="spawn")
    finally:
        pool.close()


def test_the_ray_backend_without_ray_says_how_to_install_it():
    code = ("import sys; sys.modules['ray'] = None\n"
            "import extsrc\n"
            "try:\n"
            "    extsrc.WorkerPool(2, backend='ray')\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "backend='ray' needs Ray" in out.stdout and "pip install 'extsrc[ray]'" in out.stdout, out.stderr
