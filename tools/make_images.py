"""Regenerates the bundled image set: ``python tools/make_images.py`` (from a source checkout).

Writes ``images/img_NNN.jpg`` (64 JPEGs, each side 48..160 px, a coloured
pattern with one large digit drawn on it) and ``labels.txt`` (``file label``
per line, the label being the digit) into ``extsrc/data/``, where the demo and
the tutorials read them (``--out`` for another folder). The output depends only
on the seed below (and on the JPEG encoder of the installed Pillow), so the set
can be rebuilt instead of downloaded. Needs NumPy and Pillow.
"""

from __future__ import annotations

import argparse
import os
from typing import List, Tuple

import numpy as np
from PIL import Image, ImageDraw

SEED = 20240611
COUNT = 64
MIN_SIDE, MAX_SIDE = 48, 160
QUALITY = 85

# Seven-segment layout: segment name -> (x0, y0, x1, y1) in a 4 x 7 unit box.
_SEGMENTS = {
    "a": (0.5, 0.0, 3.5, 1.0),
    "b": (3.0, 0.5, 4.0, 3.5),
    "c": (3.0, 3.5, 4.0, 6.5),
    "d": (0.5, 6.0, 3.5, 7.0),
    "e": (0.0, 3.5, 1.0, 6.5),
    "f": (0.0, 0.5, 1.0, 3.5),
    "g": (0.5, 3.0, 3.5, 4.0),
}
_DIGITS = {
    0: "abcdef", 1: "bc", 2: "abdeg", 3: "abcdg", 4: "bcfg",
    5: "acdfg", 6: "acdefg", 7: "abc", 8: "abcdefg", 9: "abcdfg",
}


def _colour(rng: np.random.Generator) -> np.ndarray:
    """A saturated colour: one channel high, one low, one anywhere."""
    channels = rng.permutation(3)
    colour = np.empty(3)
    colour[channels[0]] = rng.uniform(190, 255)
    colour[channels[1]] = rng.uniform(0, 70)
    colour[channels[2]] = rng.uniform(0, 255)
    return colour


def _pattern(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """An ``(height, width, 3)`` uint8 background: gradient, stripes, checks or rings."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    first, second = _colour(rng), _colour(rng)
    kind = rng.integers(4)
    if kind == 0:  # linear gradient at a random angle
        angle = rng.uniform(0, np.pi)
        t = x * np.cos(angle) + y * np.sin(angle)
        t = (t - t.min()) / max(t.max() - t.min(), 1.0)
    elif kind == 1:  # stripes
        angle = rng.uniform(0, np.pi)
        period = rng.uniform(8, 24)
        t = (np.sin((x * np.cos(angle) + y * np.sin(angle)) * 2 * np.pi / period) + 1) / 2
    elif kind == 2:  # checkerboard
        cell = int(rng.integers(6, 20))
        t = ((x // cell + y // cell) % 2).astype(np.float64)
    else:  # rings around a random centre
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        period = rng.uniform(10, 28)
        t = (np.cos(np.hypot(x - cx, y - cy) * 2 * np.pi / period) + 1) / 2
    image = first * (1 - t[..., None]) + second * t[..., None]
    return np.clip(image, 0, 255).astype(np.uint8)


def _draw_digit(draw: ImageDraw.ImageDraw, digit: int, box: Tuple[float, float, float, float],
                colour: Tuple[int, int, int]) -> None:
    """Draws ``digit`` as seven-segment bars filling ``box`` (x0, y0, x1, y1)."""
    x0, y0, x1, y1 = box
    sx, sy = (x1 - x0) / 4.0, (y1 - y0) / 7.0
    for name in _DIGITS[digit]:
        a, b, c, d = _SEGMENTS[name]
        draw.rectangle((x0 + a * sx, y0 + b * sy, x0 + c * sx, y0 + d * sy), fill=colour)


def make_image(rng: np.random.Generator, digit: int) -> Image.Image:
    """One image: a random-size pattern with ``digit`` on a plate in the middle."""
    height, width = (int(v) for v in rng.integers(MIN_SIDE, MAX_SIDE + 1, size=2))
    image = Image.fromarray(_pattern(rng, height, width), "RGB")
    draw = ImageDraw.Draw(image)
    digit_h = 0.62 * min(height, width * 7 / 4 * 0.8)
    digit_w = digit_h * 4 / 7
    cx, cy = width / 2, height / 2
    pad = 0.12 * digit_h
    light = bool(rng.integers(2))
    plate, ink = ((245, 245, 240), (20, 20, 30)) if light else ((20, 20, 30), (250, 250, 245))
    draw.rectangle((cx - digit_w / 2 - pad, cy - digit_h / 2 - pad,
                    cx + digit_w / 2 + pad, cy + digit_h / 2 + pad), fill=plate)
    _draw_digit(draw, digit, (cx - digit_w / 2, cy - digit_h / 2, cx + digit_w / 2, cy + digit_h / 2), ink)
    return image


def generate(out_dir: str, count: int = COUNT, seed: int = SEED) -> List[Tuple[str, int]]:
    """Writes ``count`` JPEGs to ``out_dir/images`` and ``out_dir/labels.txt``; returns the labels."""
    rng = np.random.default_rng(seed)
    image_dir = os.path.join(out_dir, "images")
    os.makedirs(image_dir, exist_ok=True)
    labels = []
    for index in range(count):
        digit = index % 10 if index < 10 else int(rng.integers(10))  # every digit at least once
        name = f"img_{index:03d}.jpg"
        make_image(rng, digit).save(os.path.join(image_dir, name), "JPEG", quality=QUALITY)
        labels.append((name, digit))
    with open(os.path.join(out_dir, "labels.txt"), "w") as f:
        f.writelines(f"{name} {label}\n" for name, label in labels)
    return labels


# The package's data folder, where the set is bundled: ../extsrc/data from this script.
BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "extsrc", "data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=BUNDLED,
                        help="folder for images/ and labels.txt (default: extsrc/data of this checkout)")
    args = parser.parse_args()
    labels = generate(args.out)
    total = sum(os.path.getsize(os.path.join(args.out, "images", n)) for n, _ in labels)
    print(f"wrote {len(labels)} images ({total / 1024:.0f} KiB) and labels.txt to {args.out}")


if __name__ == "__main__":
    main()
