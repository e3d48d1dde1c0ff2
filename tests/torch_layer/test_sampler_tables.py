"""The index tables of a loader with a sampler: read by workers of any start method, and
nothing of them left in /dev/shm even when the consumer is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from extsrc.torch import from_dataset

from faultkit import HANG_GUARD_S, unshare_small_dev_shm


class Squares:
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([i * i])


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_read_a_samplers_batches_whatever_their_start_method(start_method):
    sampler = torch.utils.data.SequentialSampler(range(24))
    loader = from_dataset(Squares(), batch_size=5, sampler=sampler, num_workers=2,
                          multiprocessing_context=start_method)
    try:
        for _ in range(3):  # past TABLES_KEPT epochs: older tables freed, the current one read
            got = [b.flatten().tolist() for b in loader]
            assert got == [[i * i for i in range(k, min(k + 5, 24))] for k in range(0, 24, 5)]
    finally:
        loader.close()


_KILLED_CONSUMER = textwrap.dedent('''
    import os, signal, torch
    from extsrc.torch import from_dataset
    class Squares:
        def __len__(self): return 24
        def __getitem__(self, i): return torch.tensor([i * i])
    if __name__ == "__main__":
        loader = from_dataset(Squares(), batch_size=4, num_workers=2,
                              sampler=torch.utils.data.RandomSampler(range(24)))
        it = iter(loader)
        next(it)
        print("MID-EPOCH", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
''')


def test_a_killed_consumer_leaves_no_index_table_in_dev_shm(tmp_path):
    wrap = unshare_small_dev_shm()
    if wrap is None:
        pytest.skip("no private /dev/shm can be mounted here")
    script = tmp_path / "consumer.py"
    script.write_text(_KILLED_CONSUMER)
    # the consumer in its own /dev/shm; once it is killed (and its workers followed it), what is left
    mount = wrap[-1].split(" && ")[0]
    command = ["unshare", "-m", "sh", "-c",
               f'{mount} && "$0" "$1"; sleep 1; echo LEFT; ls -A /dev/shm',
               sys.executable, str(script)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    out = run.stdout + run.stderr
    assert "MID-EPOCH" in out, out
    left = out.split("LEFT", 1)[1].split()
    assert [entry for entry in left if "indices" in entry] == [], out
