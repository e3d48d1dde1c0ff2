"""The image set of ``python -m extsrc bench --images``: synthetic photographs, made once, cached.

Each image is a scene drawn from the statistics of natural images, so that
decoding it costs what decoding a photograph costs: colour fields with a
``1/f`` amplitude spectrum (smooth structure at every scale, channels
correlated as in daylight), a horizon splitting the frame, occluding objects
whose sizes follow a power law (the "dead leaves" model), each with its own
colour, shading and texture, fine grain whose strength differs per surface,
and sensor noise. Encoded as baseline JPEG (Pillow, 4:2:0) at quality 90, a
500x375 image is 70-100 KB, as ImageNet photographs of that size are.

Image ``i`` depends only on ``(seed, i)`` and the size: the set is the same
whichever processes make it and in whatever order (and, for given NumPy and
Pillow builds, byte for byte). Labels are a fixed scramble of the index over
:data:`CLASSES` classes.

On disk (a folder per specification, under the cache root)::

    images/img_000000.jpg ...   the JPEGs
    labels.txt                  "images/img_000000.jpg <label>" per line: DALI's file_list format
    manifest.json               written last: the folder is complete when it exists

A set is generated in a temporary folder next to its final one and renamed
into place, so an interrupted or concurrent generation never leaves a partial
set where a complete one is expected.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np

GENERATOR_VERSION = 1  # part of the cache key: bump when the images a seed gives change
CLASSES = 1000  # as ImageNet
LABEL_MULTIPLIER = 7919  # a prime: labels scramble the index, so a shifted batch has other labels
DEFAULT_COUNT = 2000
DEFAULT_SIZE = (500, 375)  # (width, height): ImageNet's most common size
DEFAULT_QUALITY = 90
DEFAULT_SEED = 2024
MIN_SIDE = 16  # below this a scene has no room for its structure
IMAGES_PER_TASK = 25  # images per task of a generating process: progress moves every second or so

MANIFEST = "manifest.json"
LABELS = "labels.txt"
IMAGE_DIR = "images"


@dataclass(frozen=True)
class ImageSetSpec:
    """What set to make: ``count`` JPEGs of ``width`` x ``height`` at ``quality``, from ``seed``.

    Build with :meth:`create`, which checks every field.
    """

    count: int = DEFAULT_COUNT
    width: int = DEFAULT_SIZE[0]
    height: int = DEFAULT_SIZE[1]
    quality: int = DEFAULT_QUALITY
    seed: int = DEFAULT_SEED

    @classmethod
    def create(cls, count: int = DEFAULT_COUNT, width: int = DEFAULT_SIZE[0], height: int = DEFAULT_SIZE[1],
               quality: int = DEFAULT_QUALITY, seed: int = DEFAULT_SEED) -> "ImageSetSpec":
        """A checked spec; ``ValueError`` names the field, what it must be and what came."""
        for name, value, low in (("count", count, 1), ("width", width, MIN_SIDE), ("height", height, MIN_SIDE),
                                 ("quality", quality, 1), ("seed", seed, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"image set {name} must be an int >= {low}, got {value!r}")
        if quality > 95:
            raise ValueError(f"image set quality must be 1..95 (Pillow's useful JPEG range), got {quality}")
        return cls(count, width, height, quality, seed)

    @property
    def key(self) -> str:
        """The name of this set's folder under the cache root."""
        return (f"n{self.count}-{self.width}x{self.height}-q{self.quality}-s{self.seed}"
                f"-v{GENERATOR_VERSION}")


@dataclass(frozen=True)
class ImageSet:
    """A complete set on disk: its folder, spec, and files (relative to ``folder``) with labels."""

    folder: str
    spec: ImageSetSpec
    files: Tuple[str, ...]
    labels: Tuple[int, ...]
    total_bytes: int

    @property
    def labels_file(self) -> str:
        return os.path.join(self.folder, LABELS)

    def path(self, index: int) -> str:
        return os.path.join(self.folder, self.files[index])

    def __len__(self) -> int:
        return len(self.files)


def label_of(index: int) -> int:
    """The label of image ``index``."""
    return (index * LABEL_MULTIPLIER) % CLASSES


def file_name(index: int) -> str:
    return f"{IMAGE_DIR}/img_{index:06d}.jpg"


def default_root() -> str:
    """``$XDG_CACHE_HOME/extsrc/bench-images`` (``~/.cache/...`` when unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "extsrc", "bench-images")


# --- drawing -----------------------------------------------------------------------------

def _pink_noise(rng: np.random.Generator, height: int, width: int, exponent: float,
                channels: int) -> np.ndarray:
    """``(channels, height, width)`` float32 fields with amplitude spectrum ``1/f**exponent``, std 1."""
    fy = np.fft.fftfreq(height).astype(np.float32)[:, None]
    fx = np.fft.rfftfreq(width).astype(np.float32)[None, :]
    freq = np.sqrt(fy * fy + fx * fx)
    freq[0, 0] = 1.0
    amplitude = freq ** np.float32(-exponent)
    amplitude[0, 0] = 0.0  # no mean: the caller places the field
    shape = (channels, height, fx.shape[1])
    spectrum = (rng.standard_normal(shape, np.float32) + 1j * rng.standard_normal(shape, np.float32)) * amplitude
    field = np.fft.irfft2(spectrum, s=(height, width), axes=(1, 2)).astype(np.float32)
    field /= np.maximum(field.std(axis=(1, 2), keepdims=True), np.float32(1e-6))
    return field


# Fields shared by every image of a size, made once per process from the size alone (so any
# process makes the same ones): twice the image in each direction, an image takes a window at
# a random offset. They hold the full-resolution detail, which would cost most of an image's
# drawing time if made per image.
_BANKS: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
_BANK_SEED = 0x5EED


def _banks(height: int, width: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(texture, grain, noise): surface texture, fine grain (single channel) and RGB sensor noise."""
    banks = _BANKS.get((height, width))
    if banks is None:
        rng = np.random.default_rng([_BANK_SEED, height, width])
        texture = _pink_noise(rng, 2 * height, 2 * width, 0.9, 1)[0]
        grain = _pink_noise(rng, 2 * height, 2 * width, 0.6, 1)[0]
        noise = rng.standard_normal((2 * height, 2 * width, 3), np.float32)
        banks = _BANKS[(height, width)] = (texture, grain, noise)
    return banks


def _window(rng: np.random.Generator, bank: np.ndarray, y0: int, y1: int, x0: int, x1: int) -> np.ndarray:
    """Rows y0:y1 and columns x0:x1 of an image-sized window at a random offset into ``bank``."""
    oy = int(rng.integers(bank.shape[0] // 2))
    ox = int(rng.integers(bank.shape[1] // 2))
    return bank[oy + y0:oy + y1, ox + x0:ox + x1]


# Daylight colour: a luminance axis and two chroma axes (rows), chroma weaker than luminance.
_COLOUR_AXES = np.array([[1.0, 1.0, 1.0], [0.6, -0.2, -0.4], [-0.3, -0.3, 0.6]], np.float32)
_COLOUR_WEIGHTS = np.array([1.0, 0.3, 0.3], np.float32)
LEAVES = 28  # occluding objects per scene
SENSOR_NOISE = 3.0  # grey levels (std) of per-pixel noise
EDGE_SOFTNESS = 1.2  # pixels over which an object's edge blends, as a lens blurs it


def _colour(rng: np.random.Generator, low: float, high: float, spread: float) -> np.ndarray:
    """A natural (weakly saturated) colour: a grey level with a little chroma."""
    return (rng.uniform(low, high) + rng.normal(0.0, spread, 3)).astype(np.float32)


def render(spec: ImageSetSpec, index: int) -> np.ndarray:
    """Image ``index`` of the set: an ``(height, width, 3)`` uint8 scene; see the module docstring."""
    h, w = spec.height, spec.width
    rng = np.random.default_rng([spec.seed, index, GENERATOR_VERSION])
    texture, grain, noise = _banks(h, w)

    # Sky: colour fields with 1/f structure, made at a quarter of the size (only the coarse
    # scales matter there; texture and grain add the fine ones), and a vertical light gradient.
    coarse = _pink_noise(rng, (h + 3) // 4, (w + 3) // 4, 1.0, 3)
    colour_field = np.tensordot(_COLOUR_WEIGHTS[:, None] * _COLOUR_AXES, coarse, axes=(0, 0))
    canvas = _upsample(colour_field, h, w) * np.float32(rng.uniform(8, 20))
    canvas += _colour(rng, 70, 170, 20)
    canvas += np.linspace(-1, 1, h, dtype=np.float32)[:, None, None] * np.float32(rng.normal(0, 25))
    canvas += _window(rng, texture, 0, h, 0, w)[..., None] * np.float32(rng.uniform(4, 14))
    grain_strength = np.full((h, w), rng.lognormal(2.2, 0.5), np.float32)

    # Ground: a half plane below a tilted horizon, its own colour, texture and grain.
    angle, offset = rng.uniform(-0.4, 0.4), rng.uniform(-0.3, 0.6) * h / 2
    ys = np.arange(h, dtype=np.float32)[:, None] - h / 2
    xs = np.arange(w, dtype=np.float32)[None, :] - w / 2
    depth = ys * np.float32(np.cos(angle)) - xs * np.float32(np.sin(angle)) - np.float32(offset)
    ground_alpha = np.clip(depth / np.float32(EDGE_SOFTNESS) + 0.5, 0, 1)
    ground = (_window(rng, texture, 0, h, 0, w) * np.float32(rng.uniform(8, 25))
              + depth * np.float32(rng.normal(0, 40) / h))[..., None] + _colour(rng, 40, 180, 25)
    canvas += (ground - canvas) * ground_alpha[..., None]
    grain_strength += (np.float32(rng.lognormal(2.4, 0.5)) - grain_strength) * ground_alpha

    # Dead leaves: ellipses with power-law radii (density ~ r^-2.6), painted in random order.
    r_min, r_max, power = 0.04 * min(h, w), 0.55 * min(h, w), 1.6
    u = rng.random(LEAVES)
    radii = (r_min ** -power + u * (r_max ** -power - r_min ** -power)) ** (-1 / power)
    for a in radii:
        b = a * rng.uniform(0.35, 1.0)
        theta = rng.uniform(0, np.pi)
        cy, cx = rng.uniform(0, h), rng.uniform(0, w)
        reach = int(a) + 2
        y0, y1 = max(0, int(cy) - reach), min(h, int(cy) + reach + 1)
        x0, x1 = max(0, int(cx) - reach), min(w, int(cx) + reach + 1)
        if y0 >= y1 or x0 >= x1:
            continue
        dy = np.arange(y0, y1, dtype=np.float32)[:, None] - np.float32(cy)
        dx = np.arange(x0, x1, dtype=np.float32)[None, :] - np.float32(cx)
        cos, sin = np.float32(np.cos(theta)), np.float32(np.sin(theta))
        along = (dx * cos + dy * sin) * np.float32(1 / a)
        across = (dy * cos - dx * sin) * np.float32(1 / b)
        alpha = np.clip((1 - np.sqrt(along * along + across * across)) * np.float32(b / EDGE_SOFTNESS) + 0.5, 0, 1)
        shade = along * np.float32(rng.normal(0, 20)) + across * np.float32(rng.normal(0, 20))
        shade += _window(rng, texture, y0, y1, x0, x1) * np.float32(rng.uniform(3, 16))
        leaf = shade[..., None] + _colour(rng, 25, 230, 28)
        region = canvas[y0:y1, x0:x1]
        region += (leaf - region) * alpha[..., None]
        strength = grain_strength[y0:y1, x0:x1]
        strength += (np.float32(rng.lognormal(2.2, 0.8)) - strength) * alpha

    grain_strength *= _window(rng, grain, 0, h, 0, w)
    canvas += grain_strength[..., None]
    canvas += _window(rng, noise, 0, h, 0, w) * np.float32(SENSOR_NOISE)
    canvas += 0.5  # round, not truncate
    return np.clip(canvas, 0, 255).astype(np.uint8)


def _upsample(fields: np.ndarray, height: int, width: int) -> np.ndarray:
    """``(C, h, w)`` float32 fields resized (bilinear) to ``(height, width, C)``."""
    from PIL import Image

    return np.stack([np.asarray(Image.fromarray(np.ascontiguousarray(c), "F").resize(
        (width, height), Image.BILINEAR)) for c in fields], axis=-1)


def encode(spec: ImageSetSpec, index: int) -> bytes:
    """Image ``index`` as JPEG bytes."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(render(spec, index), "RGB").save(out, "JPEG", quality=spec.quality)
    return out.getvalue()


# --- the set on disk ---------------------------------------------------------------------

def _write_range(job: Tuple[ImageSetSpec, str, int, int]) -> Tuple[int, int]:
    """Writes images ``start..stop-1`` into ``folder``; returns (images written, bytes)."""
    spec, folder, start, stop = job
    written = 0
    for index in range(start, stop):
        data = encode(spec, index)
        with open(os.path.join(folder, file_name(index)), "wb") as f:
            f.write(data)
        written += len(data)
    return stop - start, written


def _progress(total: int, enabled: bool) -> Callable[[int], None]:
    """A callable advancing a progress bar by n images (tqdm when installed, else stderr lines)."""
    if not enabled:
        return lambda n: None
    try:
        from tqdm import tqdm
    except ImportError:
        state = {"done": 0, "shown": 0.0}

        def advance(n: int) -> None:
            state["done"] += n
            now = time.monotonic()
            if state["done"] == total or now - state["shown"] >= 2.0:
                state["shown"] = now
                print(f"  {state['done']}/{total} images", file=sys.stderr, flush=True)
        return advance
    bar = tqdm(total=total, unit="img", desc="generating images", file=sys.stderr, leave=False)

    def advance(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()
    return advance


def load(folder: str) -> ImageSet:
    """The complete set in ``folder``; ``FileNotFoundError`` when it is not one (no manifest)."""
    with open(os.path.join(folder, MANIFEST)) as f:
        manifest = json.load(f)
    spec = ImageSetSpec.create(**manifest["spec"])
    files, labels = [], []
    with open(os.path.join(folder, LABELS)) as f:
        for line in f:
            if line.strip():
                name, label = line.split()
                files.append(name)
                labels.append(int(label))
    if len(files) != spec.count:
        raise ValueError(f"{folder}: {LABELS} lists {len(files)} images, its manifest says {spec.count}")
    return ImageSet(folder, spec, tuple(files), tuple(labels), int(manifest["total_bytes"]))


def ensure(spec: ImageSetSpec, root: Optional[str] = None, processes: int = 1,
           progress: bool = True) -> ImageSet:
    """The set ``spec`` under ``root`` (default :func:`default_root`), generated first if missing.

    ``processes`` > 1 draws images in that many processes (spawned, so that
    this process's threads do not matter). A complete set found is used as
    is. Raises ``OSError`` when the root cannot be written.
    """
    root = os.path.abspath(root or default_root())
    folder = os.path.join(root, spec.key)
    if os.path.exists(os.path.join(folder, MANIFEST)):
        return load(folder)
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{spec.key}.", dir=root)
    try:
        os.makedirs(os.path.join(work, IMAGE_DIR))
        started = time.perf_counter()
        total_bytes = _generate(spec, work, processes, _progress(spec.count, progress))
        with open(os.path.join(work, LABELS), "w") as f:
            f.writelines(f"{file_name(i)} {label_of(i)}\n" for i in range(spec.count))
        manifest = {"spec": asdict(spec), "generator_version": GENERATOR_VERSION,
                    "total_bytes": total_bytes, "seconds": time.perf_counter() - started}
        with open(os.path.join(work, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        try:
            os.rename(work, folder)
        except OSError:
            if not os.path.exists(os.path.join(folder, MANIFEST)):
                raise
            # another process completed the same set first: use theirs (identical)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return load(folder)


def _generate(spec: ImageSetSpec, folder: str, processes: int, advance: Callable[[int], None]) -> int:
    jobs = [(spec, folder, start, min(start + IMAGES_PER_TASK, spec.count))
            for start in range(0, spec.count, IMAGES_PER_TASK)]
    total = 0
    if processes <= 1:
        for job in jobs:
            done, size = _write_range(job)
            advance(done)
            total += size
        return total
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        for done, size in pool.imap_unordered(_write_range, jobs):
            advance(done)
            total += size
    return total


def read_all(images: ImageSet) -> None:
    """Reads every file once, so that every loader then reads from the page cache."""
    for index in range(len(images)):
        with open(images.path(index), "rb") as f:
            while f.read(1 << 20):
                pass
