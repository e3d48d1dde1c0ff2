"""Unit tests: the copy of large samples into a slot past the caches (extsrc.shm.streaming)."""

import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from extsrc.shm import streaming

MIB = 1 << 20
needs_build = pytest.mark.skipif(not streaming.available(), reason=streaming.why_not())


def test_the_streaming_copy_is_built_where_a_compiler_was_there():
    # The install compiles extsrc/shm/_stream.c; a machine with a C compiler that ends up
    # without it copies every large sample about a third slower, silently.
    if os.environ.get(streaming.ENV_SWITCH) == "0":
        pytest.skip("turned off in this environment")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the optional build is expected to be missing")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no Python headers here: the optional build is expected to be missing")
    assert streaming.available(), streaming.why_not()


@needs_build
@pytest.mark.parametrize("size", [MIB, MIB + 1, MIB + 63, MIB + 64, 3 * MIB + 17])
@pytest.mark.parametrize("dst_offset,src_offset", [(0, 0), (1, 0), (0, 5), (17, 40), (63, 1)])
def test_every_byte_arrives_and_none_around_it_changes(size, dst_offset, src_offset):
    rng = np.random.default_rng(size + dst_offset)
    source_buffer = rng.integers(0, 256, size + 128, dtype=np.uint8)
    source = source_buffer[src_offset:src_offset + size]
    target = np.full(size + 256, 0xAB, np.uint8)
    destination = target[64 + dst_offset:64 + dst_offset + size]
    streaming.copy(destination, source)
    assert np.array_equal(destination, source)
    assert (target[:64 + dst_offset] == 0xAB).all()  # nothing written before or after
    assert (target[64 + dst_offset + size:] == 0xAB).all()


@needs_build
def test_typed_arrays_of_one_shape_are_copied_as_numpy_would():
    source = np.arange(3 * MIB // 4, dtype=np.float32).reshape(3, -1) * 0.5
    destination = np.zeros_like(source)
    streaming.copy(destination, source)
    assert np.array_equal(destination, source)


def test_overlapping_arrays_are_copied_as_numpy_copies_them():
    data = np.arange(3 * MIB, dtype=np.uint8)
    expected = data.copy()
    expected[100:] = expected[:-100].copy()
    streaming.copy(data[100:], data[:-100])
    assert np.array_equal(data, expected)


def test_small_strided_or_mismatched_arrays_fall_back_to_numpys_assignment():
    small_source = np.arange(100, dtype=np.int64)
    small = np.zeros(100, np.int64)
    streaming.copy(small, small_source)
    assert np.array_equal(small, small_source)
    strided_source = np.arange(2 * MIB, dtype=np.uint8)[::2]  # not contiguous
    strided = np.zeros(MIB, np.uint8)
    streaming.copy(strided, strided_source)
    assert np.array_equal(strided, strided_source)
    with pytest.raises(ValueError):  # as `destination[...] = source` raises
        streaming.copy(np.zeros(2 * MIB, np.uint8), np.zeros(MIB, np.uint8))


@needs_build
def test_the_compiled_copy_refuses_buffers_that_differ_or_cannot_be_written():
    from extsrc.shm import _stream

    with pytest.raises(ValueError, match="destination has 10 bytes, the source 11"):
        _stream.copy(bytearray(10), bytes(11))
    with pytest.raises(TypeError):
        _stream.copy(bytes(10), bytes(10))  # read-only destination


def test_the_environment_switch_turns_it_off_and_says_so():
    code = ("from extsrc.shm import streaming; import numpy as np;"
            "a = np.ones(2 << 20, np.uint8); b = np.zeros_like(a); streaming.copy(b, a);"
            "print(streaming.available(), bool(b.all()), streaming.why_not())")
    env = dict(os.environ, **{streaming.ENV_SWITCH: "0"})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"False True turned off by {streaming.ENV_SWITCH}=0"
