"""Tests of ``extsrc.dynamic`` (DALI's dynamic mode): skipped without DALI."""

try:
    import nvidia.dali.experimental.dynamic  # noqa: F401
except ImportError:  # the DALI extra is not installed: nothing here can run
    collect_ignore_glob = ["test_*.py"]
