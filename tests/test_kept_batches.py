"""A consumer that keeps every batch: memory grows with what it keeps, descriptors do not.

Each case runs in its own interpreter with a time limit, under a low descriptor limit
(``ulimit -n 64``), as in a container or a shell with a tight limit.
"""

import pytest

from faultkit import run_isolated

SCRIPT = '''
import os, resource
import numpy as np
import extsrc

def sample(info):
    return np.full(1024, info.idx_in_epoch, np.int64)

if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    kept = []
    with extsrc.ParallelSource(sample, 4, num_workers=2, start_method="{method}",
                               order=extsrc.Order({batches} * 4), timeout=120) as source:
        for batch in source:
            kept.append(batch.as_array())  # every batch kept, as a list of tensors would be
        descriptors = len(os.listdir("/proc/self/fd"))
        for i, array in enumerate(kept):  # each still reads what its samples were
            expected = np.repeat(np.arange(4 * i, 4 * i + 4), 1024).reshape(4, 1024)
            assert (array == expected).all(), i
    print("KEPT", len(kept), "DESCRIPTORS", descriptors, flush=True)
'''


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_keeping_every_batch_takes_no_descriptor_per_batch(method):
    out = run_isolated(SCRIPT.format(method=method, batches=300), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    assert words[:2] == ["KEPT", "300"], out.stdout
    assert int(words[3]) < 64, out.stdout
