"""GPU checks of extsrc.torch and extsrc.cupy, each run in its own process by test_gpu.py.

They initialise CUDA, after which a process can no longer fork workers;
running them apart keeps the pytest process free of CUDA. Usage:
``python gpu_checks.py NAME``; prints ``OK NAME`` on success, or
``SKIP NAME: why`` when a library the check needs is missing.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from extsrc import Order, ParallelSource

MIB = 1 << 20
GPU_LAG_CYCLES = 20_000_000  # torch.cuda._sleep: keeps the GPU well behind the CPU (~10 ms)
PRODUCE_S = 3  # time for two workers to write a prefetched epoch of 768 MiB, with room to spare


class Skip(Exception):
    pass


def stamped(info):
    """Sample: 256 KiB of the record's low byte, and the record."""
    return np.full((256 << 10,), info.record % 251, np.uint8), np.array([info.record], np.int64)


def ragged(info):
    """Sample: record + 0..n-1 for n = record % 5 + 1 (ragged), as float32."""
    return np.arange(info.record % 5 + 1, dtype=np.float32) + info.record


def large(info):
    return np.full((16 * MIB,), info.record % 251, np.uint8)


def _torch():
    """PyTorch, if built with CUDA; asks nothing of CUDA (fork workers must start first)."""
    try:
        import torch
    except ImportError:
        raise Skip("PyTorch is not installed") from None
    if torch.version.cuda is None:
        raise Skip(f"this PyTorch ({torch.__version__}) is built without CUDA")
    return torch


def torch_pinned_cpu_tensors() -> None:
    """pin_memory=True: CPU tensors in page-locked memory; copies queued behind a lagging GPU and
    then dropped still read the right batch (the loader keeps it until the queued work is done)."""
    from extsrc.torch import TorchLoader

    torch = _torch()
    with ParallelSource(stamped, 16, num_outputs=2, num_workers=2, order=Order(640)) as source:
        loader = TorchLoader(source, pin_memory=True)
        copies = []
        for i, (payload, records) in enumerate(loader):
            if i > 0:  # the first batch is a copy made while the memory was sized
                assert payload.is_pinned() and records.is_pinned(), f"batch {i} is not page-locked"
            torch.cuda._sleep(GPU_LAG_CYCLES // 10)  # the copy waits behind this
            copies.append((payload.cuda(non_blocking=True), records.cuda(non_blocking=True)))
            del payload, records  # nothing but the loader keeps the host batch now
        torch.cuda.synchronize()
        for i, (payload, records) in enumerate(copies):
            expected = torch.arange(i * 16, (i + 1) * 16, device="cuda")
            assert torch.equal(records[:, 0], expected), f"batch {i}: records {records[:4, 0].tolist()}"
            assert torch.equal(payload[:, 0].long(), expected % 251), f"batch {i}: wrong bytes"
            assert torch.equal(payload[:, -1].long(), expected % 251), f"batch {i}: wrong bytes"


def torch_device_cuda() -> None:
    """device="cuda": dense and ragged batches arrive as CUDA tensors with the right values over
    two epochs, kept tensors stay right, and the state points at the next batch."""
    from extsrc.torch import TorchLoader

    torch = _torch()
    with ParallelSource(ragged, 8, num_workers=2, order=Order(60), last_batch="partial") as source:
        loader = TorchLoader(source, device="cuda", pin_memory=True)
        kept = []
        for epoch in range(2):
            for i, batch in enumerate(loader):
                assert isinstance(batch, list) and all(t.is_cuda for t in batch)
                torch.cuda._sleep(GPU_LAG_CYCLES // 10)
                kept.append((epoch, i, batch))
        assert loader.state_dict() == {**source.get_state(), "epoch_idx": 2, "iteration": 0}
        torch.cuda.synchronize()
        for epoch, i, batch in kept:
            records = range(i * 8, min(60, (i + 1) * 8))
            assert [t.cpu().tolist() for t in batch] == [
                [float(r + k) for k in range(r % 5 + 1)] for r in records
            ], f"epoch {epoch} batch {i}"
        loader.close()
    with ParallelSource(stamped, 16, num_outputs=2, num_workers=2, order=Order(320)) as source:
        with TorchLoader(source, device="cuda:0") as loader:  # pageable copies: right, if slower
            for i, (payload, records) in enumerate(loader):
                assert payload.is_cuda and records.is_cuda
                expected = torch.arange(i * 16, (i + 1) * 16, device="cuda")
                assert torch.equal(records[:, 0], expected) and torch.equal(payload[:, 7].long(), expected % 251)


def _loop_seconds(torch, batches, compute_cycles: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches:
        torch.cuda._sleep(compute_cycles)
        batch.sum()  # the step uses its batch
    torch.cuda.synchronize()
    return time.perf_counter() - start


def torch_copy_overlaps_compute() -> None:
    """device="cuda": each copy runs on the side stream while the previous batch is computed on,
    so a loop takes clearly less than copy time + compute time, which copying on the current
    stream (what `.cuda()` in the loop does) takes."""
    from extsrc.torch import TorchLoader

    count, compute_cycles = 12, 8_000_000
    torch = _torch()
    with ParallelSource(large, 4, num_workers=2, order=Order(4 * count), prefetch=count) as source:
        loader = TorchLoader(source, device="cuda", pin_memory=True)
        list(loader)  # sizes and page-locks the memory
        epoch = iter(loader)
        time.sleep(PRODUCE_S)  # every batch of the epoch is ready: the loop measures the copies
        overlapped = _loop_seconds(torch, epoch, compute_cycles)
    with ParallelSource(large, 4, num_workers=2, order=Order(4 * count), prefetch=count) as source:
        host = TorchLoader(source, pin_memory=True)
        list(host)
        epoch = iter(host)
        time.sleep(PRODUCE_S)
        serial = _loop_seconds(torch, (b.cuda(non_blocking=True) for b in epoch), compute_cycles)
    compute_only = _loop_seconds(torch, [torch.zeros(1, device="cuda")] * count, compute_cycles)
    copy_only = serial - compute_only
    print(f"overlapped {overlapped * 1e3:.1f} ms, serial {serial * 1e3:.1f} ms, "
          f"compute {compute_only * 1e3:.1f} ms")
    assert copy_only > 0.2 * compute_only, "the copies are too short to show an overlap here"
    assert overlapped < serial - 0.4 * min(copy_only, compute_only), (overlapped, serial)


def torch_fork_after_cuda_refused() -> None:
    """Real CUDA first, then a fork source for a loader: refused with the advice."""
    from extsrc.torch import TorchLoader

    torch = _torch()
    torch.zeros(1, device="cuda")  # real CUDA: a context in this process
    with ParallelSource(stamped, 4, num_outputs=2, num_workers=1) as source:
        try:
            TorchLoader(source, device="cuda")
        except RuntimeError as exc:
            assert "start_method='spawn'" in str(exc) and "ParallelSource.start()" in str(exc), exc
        else:
            raise AssertionError("fork after CUDA initialisation was not refused")
    with ParallelSource(stamped, 4, num_outputs=2, num_workers=1, start_method="spawn",
                        order=Order(8)) as source:
        with TorchLoader(source, device="cuda", pin_memory=True) as loader:
            assert [int(r[0, 0]) for _p, r in loader] == [0, 4]


def cupy_to_device() -> None:
    """page_lock + to_device: CuPy arrays with the right values (dense, ragged, two outputs),
    queued on a stream; the memory is registered host memory; DLPack gives torch tensors."""
    try:
        import cupy
    except ImportError:
        raise Skip("CuPy is not installed") from None
    import extsrc.cupy

    with ParallelSource(stamped, 16, num_outputs=2, num_workers=2, order=Order(320)) as source:
        extsrc.cupy.page_lock(source)
        stream = cupy.cuda.Stream(non_blocking=True)
        results = []
        for i, batch in enumerate(source):
            if i > 0:
                address = batch[0].as_array().ctypes.data
                attributes = cupy.cuda.runtime.pointerGetAttributes(address)
                assert attributes.type == cupy.cuda.runtime.memoryTypeHost, f"batch {i} not registered"
            results.append(extsrc.cupy.to_device(batch, stream))
            del batch
        stream.synchronize()
        for i, (payload, records) in enumerate(results):
            expected = cupy.arange(i * 16, (i + 1) * 16)
            assert (records[:, 0] == expected).all() and (payload[:, 3] == expected % 251).all()
        extsrc.cupy.wait()
        assert extsrc.cupy.copies_in_flight() == 0
    with ParallelSource(ragged, 4, num_workers=1, order=Order(8)) as source:
        for i, batch in enumerate(source):
            arrays = extsrc.cupy.to_device(batch)
            assert isinstance(arrays, list)
            assert [a.get().tolist() for a in arrays] == [
                [float(r + k) for k in range(r % 5 + 1)] for r in range(i * 4, i * 4 + 4)
            ]
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        array = cupy.arange(6, dtype=cupy.float32)
        tensor = torch.from_dlpack(array)
        assert tensor.is_cuda and tensor.data_ptr() == array.data.ptr  # the same memory


if __name__ == "__main__":
    check = sys.argv[1]
    try:
        globals()[check]()
    except Skip as why:
        print(f"SKIP {check}: {why}")
        sys.exit(0)
    print("OK", check)
