"""Build of the one compiled part: extsrc.shm._stream (optional; extsrc runs without it)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # optional: without a C compiler or Python's headers the install still succeeds, and
        # large samples are copied with NumPy (`python -m extsrc doctor` says which).
        Extension("extsrc.shm._stream", ["extsrc/shm/_stream.c"], optional=True,
                  extra_compile_args=["-O2"]),
    ],
)
