"""GPU checks of the DALI layer, each run in its own process by test_cuda.py.

They initialise CUDA, after which this process could no longer fork workers;
running them apart keeps the pytest process free of CUDA for the fork tests.
Usage: ``python cuda_checks.py NAME``; prints ``OK NAME`` on success.
"""

from __future__ import annotations

import io
import os
import sys
from importlib.resources import files

import numpy as np

IMAGE_DIR = str(files("extsrc") / "data" / "images")
NAMES = sorted(os.listdir(IMAGE_DIR))[:12]


class JpegFiles:
    """Sample i: the encoded bytes of the i-th bundled JPEG (ends after 12)."""

    def __call__(self, info):
        if info.idx_in_epoch >= len(NAMES):
            raise StopIteration
        with open(os.path.join(IMAGE_DIR, NAMES[info.idx_in_epoch]), "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8)


def _reference(i: int) -> np.ndarray:
    from PIL import Image

    with open(os.path.join(IMAGE_DIR, NAMES[i]), "rb") as f:
        return np.asarray(Image.open(io.BytesIO(f.read())).convert("RGB"))


def mixed_decoder(start_method: str = "fork") -> None:
    """fn.decoders.image(device="mixed") decodes the extsrc buffers; same pixels as PIL (+-)."""
    from nvidia.dali import types

    from extsrc import fn, pipeline_def

    @pipeline_def(batch_size=4, num_threads=2, device_id=0, py_num_workers=2, py_start_method=start_method)
    def pipe():
        jpegs = fn.external_source(JpegFiles(), parallel=True, batch=False, dtype=types.UINT8)
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
        return images, fn.resize(images, size=[16, 16]), jpegs

    with pipe() as p:
        p.start_py_workers()
        p.build()
        for _epoch in range(2):
            seen = 0
            while True:
                try:
                    images, small, jpegs = p.run()
                except StopIteration:
                    p.reset()
                    break
                images = images.as_cpu()
                for k in range(len(images)):
                    got = np.array(images[k])
                    want = _reference(seen + k)
                    assert got.shape == want.shape, (got.shape, want.shape)
                    diff = np.abs(got.astype(int) - want.astype(int)).mean()
                    assert diff < 3.0, f"image {seen + k}: mean difference {diff}"
                assert small.as_cpu().as_array().shape == (4, 16, 16, 3)
                seen += len(images)
            assert seen == 12, seen


def mixed_decoder_spawn() -> None:
    mixed_decoder("spawn")


def fork_after_cuda_refused() -> None:
    """Real CUDA: a second pipeline cannot fork after the first one built on the GPU."""
    from extsrc import fn, pipeline_def

    @pipeline_def(batch_size=4, num_threads=2, device_id=0, py_num_workers=1)
    def pipe():
        return fn.decoders.image(fn.external_source(JpegFiles(), parallel=True, batch=False), device="mixed")

    with pipe() as first:
        first.build()  # starts the workers, then creates the CUDA context
        first.run()
        with pipe() as second:
            try:
                second.build()
            except RuntimeError as exc:
                assert "start_py_workers()" in str(exc) and "spawn" in str(exc), exc
            else:
                raise AssertionError("fork after CUDA initialisation was not refused")


def outputs_kept_on_gpu() -> None:
    """The #6027 scenario with a GPU pipeline: CPU outputs returned directly stay right."""
    from extsrc import fn, pipeline_def

    def stamped(info):
        if info.idx_in_epoch >= 16:
            raise StopIteration
        return np.full((256,), info.idx_in_epoch + 1000 * info.epoch_idx, dtype=np.float32)

    @pipeline_def(batch_size=2, num_threads=2, device_id=0, py_num_workers=2)
    def pipe():
        x = fn.external_source(stamped, parallel=True, batch=False)
        return x, x.gpu() * 2

    kept = []
    with pipe() as p:
        for epoch in range(2):
            it = 0
            while True:
                try:
                    kept.append((p.run(), it, epoch))
                except StopIteration:
                    p.reset()
                    break
                it += 1
        for (cpu, gpu), it, epoch in kept:
            gpu = gpu.as_cpu()
            for k in range(2):
                stamp = 1000 * epoch + it * 2 + k
                assert (np.array(cpu[k]) == stamp).all()
                assert (np.array(gpu[k]) == 2 * stamp).all()


def jpeg_and_record(info):
    """Two outputs: the encoded bytes of the bundled JPEG ``info.record``, and the record."""
    with open(os.path.join(IMAGE_DIR, NAMES[info.record]), "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8), np.array([info.record], np.int32)


def iterator_mixed_decoder() -> None:
    """DALIClassificationIterator(reader_name=) over a spawn extsrc pipeline decoding on the GPU:
    CUDA tensors with the pixels of a CPU decode, each image once per epoch (PARTIAL)."""
    from nvidia.dali import types
    from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy

    from extsrc import Order, fn, pipeline_def

    order = Order(len(NAMES), shuffle=True, seed=1)  # 12 images in batches of 5: the last padded

    def define(device):
        @pipeline_def(batch_size=5, num_threads=2, device_id=0 if device == "mixed" else None,
                      py_num_workers=2, py_start_method="spawn")
        def pipe():
            jpegs, records = fn.external_source(jpeg_and_record, num_outputs=2, parallel=True,
                                                order=order, last_batch="pad", name="src",
                                                dtype=[types.UINT8, types.INT32])
            images = fn.decoders.image(jpegs, device=device, output_type=types.RGB)
            return fn.resize(images, size=[32, 32]), records

        return pipe()

    reference = {}
    with define("cpu") as cpu:
        for (out,) in DALIClassificationIterator(cpu, reader_name="src",
                                                 last_batch_policy=LastBatchPolicy.PARTIAL):
            for image, record in zip(out["data"], out["label"][:, 0].tolist()):
                reference[record] = image.numpy().astype(int)
    assert sorted(reference) == list(range(len(NAMES)))
    with define("mixed") as gpu:
        iterator = DALIClassificationIterator(gpu, reader_name="src", auto_reset=True,
                                              last_batch_policy=LastBatchPolicy.PARTIAL)
        for epoch in range(2):
            seen = []
            for (out,) in iterator:
                assert out["data"].is_cuda and out["data"].shape[1:] == (32, 32, 3)
                for image, record in zip(out["data"].cpu().numpy(), out["label"][:, 0].tolist()):
                    diff = np.abs(image.astype(int) - reference[record]).mean()
                    assert diff < 3.0, f"epoch {epoch}, image {record}: mean difference {diff}"
                    seen.append(record)
            assert seen == list(order.epoch(epoch)), (epoch, seen)


if __name__ == "__main__":
    check = sys.argv[1]
    globals()[check]()
    print("OK", check)
