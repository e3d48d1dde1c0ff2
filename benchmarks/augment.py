"""The image workload's augmentation with PIL and NumPy: what torchvision's ImageNet transforms do.

``RandomResizedCrop(224)``, ``RandomHorizontalFlip()``, ``ToTensor()``,
``Normalize(MEAN, STD)``, written from torchvision's documented behaviour:
a crop covering a uniform fraction of the area in ``SCALE`` with a
log-uniform aspect ratio in ``RATIO`` (ten tries, then the largest central
crop within ``RATIO``), resized bilinearly to ``SIZE`` x ``SIZE``, mirrored
with probability 1/2, scaled to [0, 1], normalised per channel, channels
first. The same constants drive the DALI pipelines of the bench
(``fn.random_resized_crop``, ``fn.crop_mirror_normalize``).
"""

from __future__ import annotations

import math
from typing import Tuple

import numpy as np

SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10  # torchvision's attempts before its central fallback
MEAN = (0.485, 0.456, 0.406)  # ImageNet's, as in every torchvision example
STD = (0.229, 0.224, 0.225)

# Normalising in one multiply-add per channel: (x / 255 - mean) / std = x * _GAIN - _OFFSET.
_GAIN = np.array([1 / (255 * s) for s in STD], np.float32)
_OFFSET = np.array([m / s for m, s in zip(MEAN, STD)], np.float32)


def crop_box(rng: np.random.Generator, width: int, height: int) -> Tuple[int, int, int, int]:
    """A random-resized-crop window of a ``width`` x ``height`` image: (left, top, right, bottom)."""
    area = width * height
    log_low, log_high = math.log(RATIO[0]), math.log(RATIO[1])
    for _ in range(CROP_TRIES):
        target = area * rng.uniform(*SCALE)
        ratio = math.exp(rng.uniform(log_low, log_high))
        w = int(round(math.sqrt(target * ratio)))
        h = int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    aspect = width / height
    if aspect < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif aspect > RATIO[1]:
        w, h = int(round(height * RATIO[1])), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def apply(image, box: Tuple[int, int, int, int], flip: bool) -> np.ndarray:
    """A PIL image (RGB) cropped to ``box``, resized, mirrored if ``flip``, normalised: ``(3, SIZE, SIZE)`` float32."""
    from PIL import Image

    crop = image.resize((SIZE, SIZE), Image.BILINEAR, box=box)
    if flip:
        crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
    pixels = np.asarray(crop)
    out = np.empty((3, SIZE, SIZE), np.float32)
    for c in range(3):
        np.multiply(pixels[:, :, c], _GAIN[c], out=out[c])
        out[c] -= _OFFSET[c]
    return out


def augment(image, rng: np.random.Generator) -> np.ndarray:
    """:func:`apply` with a random crop (:func:`crop_box`) and a flip with probability 1/2."""
    return apply(image, crop_box(rng, image.width, image.height), bool(rng.random() < 0.5))


def load_and_augment(path: str, rng: np.random.Generator) -> np.ndarray:
    """Decodes the JPEG at ``path`` with PIL (as torchvision's ``pil_loader``) and augments it."""
    from PIL import Image

    with open(path, "rb") as f:
        image = Image.open(f).convert("RGB")
    return augment(image, rng)


def torchvision_transform():
    """The same pipeline from torchvision's ``transforms`` (``ImportError`` when it cannot be used)."""
    from torchvision import transforms

    return transforms.Compose([
        transforms.RandomResizedCrop(SIZE, scale=SCALE, ratio=RATIO),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
