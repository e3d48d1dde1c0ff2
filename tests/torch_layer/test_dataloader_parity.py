"""from_dataset behaves as torch.utils.data.DataLoader where a user would notice the difference."""

from __future__ import annotations

import sys
import os

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from faultkit import run_isolated  # noqa: E402


def test_workers_run_torch_ops_after_the_parent_used_intra_op_threads():
    # GNU OpenMP's thread pool does not survive fork: a forked child that runs a parallel op
    # waits forever for threads it does not have, unless it uses one thread, as DataLoader's
    # workers do.
    done = run_isolated("""
        import torch
        from extsrc.torch import from_dataset

        class Convolved(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                image = torch.full((1, 3, 64, 64), float(i))
                return torch.nn.functional.conv2d(image, torch.ones(4, 3, 3, 3))[0]

        torch.set_num_threads(2)
        x = torch.randn(1, 3, 256, 256)
        torch.nn.functional.conv2d(x, torch.randn(8, 3, 5, 5))  # the parent's threads start
        with from_dataset(Convolved(), batch_size=4, num_workers=2) as loader:
            sums = [batch.sum().item() for batch in loader]
        print("OK", len(sums))
    """, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "OK 2" in done.stdout
