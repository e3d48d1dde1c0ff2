"""``python -m extsrc bench``: benchmarks, apart from the library (imported only by the CLI)."""
