"""DALI-layer tests: skipped without DALI (``cuda`` tests without a GPU: ``tests/conftest.py``)."""

try:
    import nvidia.dali  # noqa: F401
except ImportError:  # the DALI extra is not installed: nothing here can run
    collect_ignore_glob = ["test_*.py"]
