"""python -m extsrc demo: decode the bundled image set through extsrc into DALI.

An extsrc parallel source reads the bundled JPEGs and labels in worker
processes; a DALI pipeline decodes them (on the GPU with ``device="mixed"``
when one is usable, else on the CPU), resizes them to a fixed size, and the
demo runs a few epochs, reports images/s and writes a contact sheet (a PNG grid
of the decoded images of the last epoch, each tile with its label in a corner).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from importlib.resources import files
from typing import List, Tuple

import numpy as np

from extsrc.engine import START_METHODS, gpu_visible

COLUMNS = 8  # tiles per row of the contact sheet
GAP = 4  # pixels around and between tiles

_GPU_PROBE = """
import ctypes, sys
try:
    driver = ctypes.CDLL("libcuda.so.1")
except OSError:
    sys.exit(1)
count = ctypes.c_int(0)
ok = driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0
sys.exit(0 if ok and count.value > 0 else 1)
"""


def data_dir() -> str:
    """The folder of the bundled image set: ``images/*.jpg`` and ``labels.txt``."""
    return str(files("extsrc") / "data")


def read_labels(folder: str) -> List[Tuple[str, int]]:
    """``(file name, label)`` pairs of ``folder/labels.txt``, in file order."""
    with open(os.path.join(folder, "labels.txt")) as f:
        return [(name, int(label)) for name, label in (line.split() for line in f if line.strip())]


class BundledJpegs:
    """Sample source: ``idx_in_epoch`` -> (encoded JPEG bytes, label as int32[1]); one epoch = the set."""

    def __init__(self, folder: str):
        self.image_dir = os.path.join(folder, "images")
        self.samples = read_labels(folder)

    def __len__(self) -> int:
        return len(self.samples)

    def __call__(self, info) -> Tuple[np.ndarray, np.ndarray]:
        if info.idx_in_epoch >= len(self.samples):
            raise StopIteration
        name, label = self.samples[info.idx_in_epoch]
        with open(os.path.join(self.image_dir, name), "rb") as f:
            encoded = np.frombuffer(f.read(), dtype=np.uint8)
        return encoded, np.array([label], dtype=np.int32)


def gpu_available() -> bool:
    """Whether CUDA sees a GPU, asked in a child process so that this one stays free to fork."""
    try:
        return subprocess.run([sys.executable, "-c", _GPU_PROBE], timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def sheet_size(count: int, size: int, columns: int = COLUMNS) -> Tuple[int, int]:
    """(width, height) in pixels of a contact sheet of ``count`` tiles of ``size`` x ``size``."""
    rows = max(1, math.ceil(count / columns))
    return columns * (size + GAP) + GAP, rows * (size + GAP) + GAP


def contact_sheet(images: np.ndarray, labels: List[int], path: str, columns: int = COLUMNS) -> None:
    """Writes ``images`` (n, size, size, 3 uint8) as a PNG grid, each tile labelled in a corner."""
    from PIL import Image, ImageDraw

    size = images.shape[1]
    sheet = Image.new("RGB", sheet_size(len(images), size, columns), (32, 32, 32))
    draw = ImageDraw.Draw(sheet)
    for index, (image, label) in enumerate(zip(images, labels)):
        x = GAP + (index % columns) * (size + GAP)
        y = GAP + (index // columns) * (size + GAP)
        sheet.paste(Image.fromarray(image), (x, y))
        draw.rectangle((x, y + size - 14, x + 12, y + size - 1), fill=(255, 220, 0))
        draw.text((x + 3, y + size - 13), str(label), fill=(0, 0, 0))
    sheet.save(path)


def main(argv: List[str]) -> int:
    """Runs the demo with command-line arguments ``argv``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m extsrc demo", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default: 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per batch (default: 16)")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the image set (default: 3)")
    parser.add_argument("--start-method", choices=START_METHODS, default="fork",
                        help="how workers start (default: fork)")
    parser.add_argument("--size", type=int, default=96, help="side of the resized images (default: 96)")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="where to decode: gpu (device='mixed'), cpu, or auto: gpu if there is one")
    parser.add_argument("--out", default="extsrc-demo.png",
                        help="contact sheet to write (default: ./extsrc-demo.png)")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.batch_size < 1 or args.epochs < 1 or args.size < 16:
        parser.error("--workers, --batch-size and --epochs must be >= 1, --size >= 16")
    if args.device == "gpu":
        visible, why = gpu_visible()
        if not visible:
            parser.error(f"--device gpu decodes on a GPU, but {why}; use --device cpu (or auto)")

    from nvidia.dali import types
    from tqdm import tqdm

    from extsrc import fn, pipeline_def

    use_gpu = args.device == "gpu" or (args.device == "auto" and gpu_available())
    source = BundledJpegs(data_dir())

    @pipeline_def(batch_size=args.batch_size, num_threads=2, device_id=0 if use_gpu else None,
                  py_num_workers=args.workers, py_start_method=args.start_method)
    def demo_pipeline():
        jpegs, labels = fn.external_source(
            source=source, num_outputs=2, batch=False, parallel=True,
            dtype=[types.DALIDataType.UINT8, types.DALIDataType.INT32], last_batch="partial",
        )
        images = fn.decoders.image(jpegs, device="mixed" if use_gpu else "cpu", output_type=types.DALIImageType.RGB)
        images = fn.resize(images, resize_x=args.size, resize_y=args.size)
        return images, labels

    pipe = demo_pipeline()
    batches_per_epoch = math.ceil(len(source) / args.batch_size)
    epochs = f"{args.epochs} epoch" + ("s" if args.epochs > 1 else "")
    print(f"extsrc demo: {len(source)} bundled JPEGs, {epochs}, batch {args.batch_size}, "
          f"{args.workers} {args.start_method} workers, decoding on "
          f"{'GPU (mixed)' if use_gpu else 'CPU'}, resized to {args.size}x{args.size}")
    try:
        pipe.start_py_workers()  # before build(): fork must happen before CUDA is initialised
        pipe.build()
        count = 0
        started = time.perf_counter()
        with tqdm(total=args.epochs * batches_per_epoch, unit="batch", file=sys.stderr) as bar:
            for epoch in range(args.epochs):
                last_images, last_labels = [], []
                try:
                    while True:
                        images, labels = pipe.run()
                        batch = images.as_cpu().as_array()
                        count += len(batch)
                        if epoch == args.epochs - 1:
                            last_images.append(batch.copy())
                            last_labels += [int(v) for v in labels.as_array().reshape(-1)]
                        bar.update(1)
                        bar.set_postfix(epoch=epoch, images=count)
                except StopIteration:
                    pipe.reset()
        elapsed = time.perf_counter() - started
    finally:
        pipe.close()  # stops DALI and the workers, frees the shared memory

    print(f"decoded {count} images in {elapsed:.2f} s: {count / elapsed:.1f} images/s")
    contact_sheet(np.concatenate(last_images), last_labels, args.out)
    print(f"contact sheet of the last epoch ({len(last_labels)} images): {os.path.abspath(args.out)}")
    return 0
