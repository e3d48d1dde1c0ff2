"""Unit tests: the bench's image set (deterministic, decodable, photograph-like) and its augmentation."""

import io
import os

import numpy as np
import pytest

from benchmarks import augment, imageset

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

TINY = imageset.ImageSetSpec.create(count=6, width=96, height=64)


def _files(image_set):
    return {name: open(os.path.join(image_set.folder, name), "rb").read() for name in image_set.files}


def test_generation_is_deterministic_and_makes_decodable_jpegs_of_the_asked_size(tmp_path):
    one = imageset.ensure(TINY, str(tmp_path / "a"), processes=1, progress=False)
    two = imageset.ensure(TINY, str(tmp_path / "b"), processes=2, progress=False)  # other processes, order
    assert one.files == two.files and len(one) == TINY.count
    first, second = _files(one), _files(two)
    assert first == second, "the same spec must give the same bytes whichever processes draw it"
    for name, data in first.items():
        assert data[:2] == b"\xff\xd8", f"{name} is not a JPEG"
        image = Image.open(io.BytesIO(data))
        assert image.format == "JPEG" and image.mode == "RGB" and image.size == (96, 64)
        image.load()  # decodes completely
    assert one.total_bytes == sum(len(d) for d in first.values())
    # labels: as listed in labels.txt (DALI's file_list format), the same for both
    with open(one.labels_file) as f:
        listed = [line.split() for line in f]
    assert listed == [[name, str(imageset.label_of(i))] for i, name in enumerate(one.files)]
    assert one.labels == two.labels


def test_another_seed_gives_other_images_and_images_differ_from_each_other():
    other = imageset.ImageSetSpec.create(count=6, width=96, height=64, seed=TINY.seed + 1)
    assert not np.array_equal(imageset.render(TINY, 0), imageset.render(other, 0))
    assert not np.array_equal(imageset.render(TINY, 0), imageset.render(TINY, 1))
    assert np.array_equal(imageset.render(TINY, 3), imageset.render(TINY, 3))


def test_a_complete_set_is_reused_not_drawn_again(tmp_path, monkeypatch):
    made = imageset.ensure(TINY, str(tmp_path), processes=1, progress=False)

    def no_drawing(*args):
        raise AssertionError("a cached set was drawn again")

    monkeypatch.setattr(imageset, "render", no_drawing)
    again = imageset.ensure(TINY, str(tmp_path), processes=1, progress=False)
    assert again == made
    assert [e for e in os.listdir(tmp_path) if e.startswith(".")] == [], "temporary folder left behind"


def test_an_interrupted_generation_leaves_no_set_behind(tmp_path, monkeypatch):
    def interrupted(spec, index):
        if index == 3:
            raise KeyboardInterrupt
        return np.zeros((spec.height, spec.width, 3), np.uint8)

    monkeypatch.setattr(imageset, "render", interrupted)
    with pytest.raises(KeyboardInterrupt):
        imageset.ensure(TINY, str(tmp_path), processes=1, progress=False)
    assert os.listdir(tmp_path) == [], "a partial set (or its temporary folder) was left"


def _spectrum_slope(image):
    """Slope of the radially averaged power spectrum of the luminance, log-log (natural images: about -2)."""
    grey = image.astype(np.float64) @ [0.299, 0.587, 0.114]
    grey -= grey.mean()
    h, w = grey.shape
    power = np.abs(np.fft.fft2(grey * np.hanning(h)[:, None] * np.hanning(w)[None, :])) ** 2
    freq = np.hypot(np.fft.fftfreq(h)[:, None], np.fft.fftfreq(w)[None, :])
    edges = np.geomspace(0.01, 0.3, 12)
    which = np.digitize(freq, edges)
    f = [freq[which == i].mean() for i in range(1, len(edges))]
    p = [power[which == i].mean() for i in range(1, len(edges))]
    return np.polyfit(np.log(f), np.log(p), 1)[0]


def test_images_have_the_statistics_of_photographs_and_their_file_size():
    spec = imageset.ImageSetSpec.create(count=4)  # the default size, 500x375
    sizes = []
    for index in range(4):
        image = imageset.render(spec, index)
        assert image.shape == (375, 500, 3) and image.dtype == np.uint8
        grey = image.astype(np.float64).mean(axis=2)
        # not flat colours: contrast; not white noise: neighbouring pixels alike, 1/f^2 power
        assert grey.std() > 20
        assert np.corrcoef(grey[:, :-1].ravel(), grey[:, 1:].ravel())[0, 1] > 0.85
        assert -3.2 < _spectrum_slope(image) < -1.6
        # colour, not grey: channels differ
        assert np.abs(image[..., 0].astype(int) - image[..., 2]).mean() > 3
        sizes.append(len(imageset.encode(spec, index)))
    assert 50_000 < np.mean(sizes) < 150_000, f"JPEGs of {np.mean(sizes):.0f} bytes on average"


def test_spec_refuses_bad_values_saying_which():
    with pytest.raises(ValueError, match="count must be an int >= 1, got 0"):
        imageset.ImageSetSpec.create(count=0)
    with pytest.raises(ValueError, match="width must be an int >= 16"):
        imageset.ImageSetSpec.create(width=8)
    with pytest.raises(ValueError, match="quality must be 1..95"):
        imageset.ImageSetSpec.create(quality=100)
    with pytest.raises(ValueError, match="count must be an int"):
        imageset.ImageSetSpec.create(count=True)


def test_crop_box_follows_random_resized_crop():
    rng = np.random.default_rng(0)
    for width, height in ((500, 375), (375, 500), (1000, 100), (30, 30)):
        for _ in range(300):
            left, top, right, bottom = augment.crop_box(rng, width, height)
            assert 0 <= left < right <= width and 0 <= top < bottom <= height
            w, h = right - left, bottom - top
            fallback = (w, h) in ((width, height), (width, round(width / augment.RATIO[0])),
                                  (round(height * augment.RATIO[1]), height))
            if not fallback:
                assert augment.SCALE[0] * 0.9 <= w * h / (width * height) <= augment.SCALE[1]
                assert augment.RATIO[0] * 0.9 <= w / h <= augment.RATIO[1] * 1.1


def test_augment_normalises_flips_and_returns_channels_first():
    ramp = np.tile(np.arange(200, dtype=np.uint8)[None, :, None], (150, 1, 3))
    image = Image.fromarray(ramp, "RGB")
    outputs = [augment.augment(image, np.random.default_rng(seed)) for seed in range(20)]
    for out in outputs:
        assert out.shape == (3, augment.SIZE, augment.SIZE) and out.dtype == np.float32
    rising = [o for o in outputs if o[0, 100, -1] > o[0, 100, 0]]
    falling = [o for o in outputs if o[0, 100, -1] < o[0, 100, 0]]
    assert rising and falling, "a left-to-right ramp must come out mirrored in some draws, not in others"

    grey = Image.fromarray(np.full((100, 120, 3), 200, np.uint8), "RGB")
    out = augment.augment(grey, np.random.default_rng(1))
    expected = [(200 / 255 - m) / s for m, s in zip(augment.MEAN, augment.STD)]
    np.testing.assert_allclose(out.mean(axis=(1, 2)), expected, rtol=1e-5)


def test_augment_matches_torchvision_on_the_same_crop():
    pytest.importorskip("torchvision", exc_type=ImportError)  # skipped where torchvision cannot be imported
    from torchvision.transforms import functional as F

    picture = Image.fromarray(imageset.render(TINY, 0), "RGB")
    left, top, right, bottom = 10, 5, 80, 60
    for flip in (False, True):
        crop = F.resized_crop(picture, top, left, bottom - top, right - left, [augment.SIZE, augment.SIZE])
        if flip:
            crop = F.hflip(crop)
        expected = F.normalize(F.to_tensor(crop), list(augment.MEAN), list(augment.STD)).numpy()
        ours = augment.apply(picture, (left, top, right, bottom), flip)
        np.testing.assert_allclose(ours, expected, atol=1e-5)
