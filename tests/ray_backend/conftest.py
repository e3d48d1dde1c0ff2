"""Ray backend tests: skipped without Ray; the in-process ones share one local Ray of 2 CPUs.

Tests that break a pool on purpose (a killed actor, a timeout, Ray shut
down), or need a cluster of their own, run in a fresh interpreter with a
time limit (``faultkit``).
"""

from __future__ import annotations

import os

import pytest

try:
    import ray  # noqa: F401
except ImportError:  # the ray extra is not installed: nothing here can run
    collect_ignore_glob = ["test_*.py"]

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.dirname(HERE)
RAY_CPUS = 2  # what CI gives the Ray tests: one CPU per actor of a two-worker pool


@pytest.fixture(scope="package")
def local_ray():
    """A local Ray for the package, whose workers can import the tests' callbacks (sources.py,
    and the test modules' own, which pickle by reference as for spawned workers)."""
    import ray

    saved = os.environ.get("PYTHONPATH")
    # Ray's processes inherit this process's environment: its actors find `sources` like we do.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, HERE, saved) if p)
    try:
        ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    yield ray
    ray.shutdown()
