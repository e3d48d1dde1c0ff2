"""The loaders of the image workload, and the cell that measures one of them.

Each loader reads the cached JPEGs (:mod:`benchmarks.imageset`) in file
order, cycling through the set, and applies the same augmentation: decode,
random resized crop to 224, horizontal flip with probability 1/2, normalise
(:mod:`benchmarks.augment`). A batch is ``(images, labels)``: images
``(batch, 3, 224, 224)`` float32, labels int.

* ``extsrc-dali`` / ``dali-external-source``: the same pipeline code with
  ``from extsrc import fn, pipeline_def`` or ``from nvidia.dali import fn,
  pipeline_def``: a parallel external source reads the file bytes in
  ``py_num_workers`` processes, DALI decodes and augments in ``num_threads``
  threads (decoding only the random crop's window, ``decode="crop"``, or the
  whole image, ``decode="full"``);
* ``dali-file-reader``: the same operators behind DALI's C++
  ``fn.readers.file``;
* ``torch``: ``torch.utils.data.DataLoader`` over a map-style dataset that
  opens each file with PIL and applies torchvision's transforms (or, where
  torchvision cannot be imported, the same operations in PIL and NumPy);
* ``extsrc``: ``extsrc.ParallelSource`` whose callback decodes with PIL and
  augments with PIL and NumPy;
* ``extsrc-ndd`` / ``ndd-in-process``: DALI's dynamic mode, the same
  operators called eagerly on each batch (``num_threads`` DALI threads); the
  file bytes come from ``extsrc.dynamic``'s parallel ``ExternalSource``
  (``workers`` processes) or from DALI's own ``ndd.ExternalSource``, which
  reads them in the consumer's thread;
* ``extsrc-ndd-pil`` / ``ndd-in-process-pil``: the same two sources decoding
  each JPEG with PIL and resizing it to 224x224 in the callback (Python work,
  as a user's own format needs), DALI then flipping and normalising.

PyTorch, torchvision and DALI are imported here only, inside the cells'
processes. Every opener returns ``(take, labels, close)``: ``take()`` the
next batch (touched as a consumer would), ``labels(batch)`` its labels (to
check that the loader delivered the right images), ``close()`` stops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from benchmarks import augment
from benchmarks.imageset import ImageSet, load

EXTSRC_DALI, DALI_SOURCE, DALI_READER, TORCH, EXTSRC, EXTSRC_NDD, NDD = (
    "extsrc-dali", "dali-external-source", "dali-file-reader", "torch", "extsrc", "extsrc-ndd",
    "ndd-in-process")
# Dynamic mode with the decoding in the source (PIL, in Python): the CPU-bound callback case.
EXTSRC_NDD_PIL, NDD_PIL = "extsrc-ndd-pil", "ndd-in-process-pil"
LOADERS = (EXTSRC_DALI, DALI_SOURCE, DALI_READER, TORCH, EXTSRC, EXTSRC_NDD, NDD, EXTSRC_NDD_PIL, NDD_PIL)
NDD_LOADERS = (EXTSRC_NDD, NDD, EXTSRC_NDD_PIL, NDD_PIL)
DALI_LOADERS = (EXTSRC_DALI, DALI_SOURCE, DALI_READER) + NDD_LOADERS
TRANSFORMS = ("torchvision", "numpy")  # what the torch loader augments with
DEVICES = ("cpu", "mixed")  # where DALI decodes ("mixed": on the GPU, with device_id 0)
# How the DALI pipelines crop: "crop" decodes only the random window (fn.decoders.image_random_crop,
# then fn.resize: DALI's documented form for training), "full" decodes the whole image first
# (fn.decoders.image, then fn.random_resized_crop). The window's distribution is the same.
DECODES = ("crop", "full")
AUGMENT_SEED = 7  # the PIL/NumPy loaders' draws are keyed by (seed, position)

Opened = Tuple[Callable[[], Any], Callable[[Any], List[int]], Callable[[], None]]


@dataclass(frozen=True)
class ImageCellSpec:
    """One image cell: ``loader`` on the set in ``folder``, ``workers`` processes/threads each."""

    loader: str
    folder: str
    batch_size: int
    workers: int
    seconds: float
    warmup_s: float
    transforms: str = "torchvision"
    device: str = "cpu"
    decode: str = "crop"

    def __post_init__(self):
        if self.loader not in LOADERS:
            raise ValueError(f"image loader must be one of {LOADERS}, got {self.loader!r}")
        if self.transforms not in TRANSFORMS:
            raise ValueError(f"transforms must be one of {TRANSFORMS}, got {self.transforms!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {self.decode!r}")


class JpegBytes:
    """Sample source for the external sources: position -> (file bytes as uint8, label as int32[1])."""

    def __init__(self, images: ImageSet):
        self.paths = [images.path(i) for i in range(len(images))]
        self.labels = list(images.labels)

    def __call__(self, info) -> Tuple[np.ndarray, np.ndarray]:
        k = info.idx_in_epoch % len(self.paths)
        return np.fromfile(self.paths[k], dtype=np.uint8), np.array([self.labels[k]], np.int32)


class DecodedImages:
    """Sample source for the engine: position -> (augmented image (3, 224, 224) float32, label int32[1])."""

    def __init__(self, images: ImageSet):
        self.paths = [images.path(i) for i in range(len(images))]
        self.labels = list(images.labels)

    def __call__(self, info) -> Tuple[np.ndarray, np.ndarray]:
        k = info.idx_in_epoch % len(self.paths)
        rng = np.random.default_rng((AUGMENT_SEED, info.idx_in_epoch))
        return augment.load_and_augment(self.paths[k], rng), np.array([self.labels[k]], np.int32)


def expected_labels(images: ImageSet, batch: int, batch_size: int) -> List[int]:
    """The labels batch ``batch`` of the stream must hold (file order, cycling through the set)."""
    return [images.labels[p % len(images)] for p in range(batch * batch_size, (batch + 1) * batch_size)]


def _dali_pipeline(spec: ImageCellSpec, images: ImageSet):
    """The pipeline of the DALI loaders: only the import (and, for the reader, the source) differ."""
    if spec.loader == EXTSRC_DALI:
        from extsrc import fn, pipeline_def
    else:
        from nvidia.dali import fn, pipeline_def
    from nvidia.dali import types

    mixed = spec.device == "mixed"

    @pipeline_def(batch_size=spec.batch_size, num_threads=spec.workers, device_id=0 if mixed else None,
                  py_num_workers=spec.workers, py_start_method="fork")
    def pipeline():
        if spec.loader == DALI_READER:
            jpegs, labels = fn.readers.file(file_root=images.folder, file_list=images.labels_file,
                                            random_shuffle=False, name="Reader")
        else:
            jpegs, labels = fn.external_source(source=JpegBytes(images), num_outputs=2, batch=False,
                                               parallel=True, dtype=[types.UINT8, types.INT32])
        decoder = "mixed" if mixed else "cpu"
        area, ratio = list(augment.SCALE), list(augment.RATIO)
        if spec.decode == "crop":
            window = fn.decoders.image_random_crop(jpegs, device=decoder, output_type=types.RGB,
                                                   random_area=area, random_aspect_ratio=ratio)
            cropped = fn.resize(window, size=(augment.SIZE, augment.SIZE))
        else:
            decoded = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB)
            cropped = fn.random_resized_crop(decoded, size=(augment.SIZE, augment.SIZE),
                                             random_area=area, random_aspect_ratio=ratio)
        normalised = fn.crop_mirror_normalize(
            cropped, mirror=fn.random.coin_flip(probability=0.5), dtype=types.FLOAT, output_layout="CHW",
            mean=[255 * m for m in augment.MEAN], std=[255 * s for s in augment.STD])
        return normalised, labels

    return pipeline()


def _open_dali(spec: ImageCellSpec, images: ImageSet) -> Opened:
    pipe = _dali_pipeline(spec, images)
    if spec.loader != DALI_READER:
        pipe.start_py_workers()  # fork the workers before build() can initialise CUDA ("mixed")
    pipe.build()
    state = {"pipe": pipe}

    def take():
        output = state["pipe"].run()
        len(output[0])  # the consumer touches the batch
        return output

    def labels(output) -> List[int]:
        images_out, labels_out = output
        if spec.device == "mixed":
            images_out = images_out.as_cpu()
        shape = tuple(images_out.as_tensor().shape())
        _check_shape(spec, shape)
        return [int(np.asarray(labels_out[k]).reshape(-1)[0]) for k in range(len(labels_out))]

    def close():
        state.clear()

    return take, labels, close


class PilResized:
    """Sample source: position -> (the JPEG decoded by PIL, resized to SIZE x SIZE, HWC uint8,
    label as int32[1])."""

    def __init__(self, images: ImageSet):
        self.paths = [images.path(i) for i in range(len(images))]
        self.labels = list(images.labels)

    def __call__(self, info) -> Tuple[np.ndarray, np.ndarray]:
        from PIL import Image

        k = info.idx_in_epoch % len(self.paths)
        with Image.open(self.paths[k]) as image:
            pixels = np.asarray(image.convert("RGB").resize((augment.SIZE, augment.SIZE), Image.BILINEAR))
        return pixels, np.array([self.labels[k]], np.int32)


class _Position:
    """The one field of ``SampleInfo`` that ``JpegBytes`` reads, for the in-process source."""

    def __init__(self, idx_in_epoch: int):
        self.idx_in_epoch = idx_in_epoch


def _ndd_source(spec: ImageCellSpec, images: ImageSet) -> Tuple[Any, Any]:
    """``(ndd, source)``: the dynamic-mode module and a source of (JPEG bytes or decoded images,
    labels) batches."""
    reader = PilResized(images) if spec.loader in (EXTSRC_NDD_PIL, NDD_PIL) else JpegBytes(images)
    if spec.loader in (EXTSRC_NDD, EXTSRC_NDD_PIL):
        import extsrc.dynamic as ndd

        source = ndd.ExternalSource(reader, 2, parallel=True, batch_size=spec.batch_size,
                                    num_workers=spec.workers, start_method="fork")
        source.start()  # fork the workers before anything can initialise CUDA
        return ndd, source
    import nvidia.dali.experimental.dynamic as ndd

    batch = [0]

    def next_batch():
        start, batch[0] = batch[0] * spec.batch_size, batch[0] + 1
        samples = [reader(_Position(start + k)) for k in range(spec.batch_size)]
        return ndd.batch([s[0] for s in samples]), ndd.batch([s[1] for s in samples])

    return ndd, ndd.ExternalSource(next_batch, 2)


def _open_ndd(spec: ImageCellSpec, images: ImageSet) -> Opened:
    """The DALI pipeline's operators in dynamic mode, called on each batch of the source."""
    from nvidia.dali.types import DALIImageType

    ndd, source = _ndd_source(spec, images)
    ndd.set_num_threads(spec.workers)
    device = "gpu" if spec.device == "mixed" else "cpu"
    area, ratio = list(augment.SCALE), list(augment.RATIO)
    mean, std = [255 * m for m in augment.MEAN], [255 * s for s in augment.STD]

    decoded_in_source = spec.loader in (EXTSRC_NDD_PIL, NDD_PIL)

    def take():
        data, labels = source()
        if decoded_in_source:
            cropped = ndd.as_batch(data, layout="HWC")
        else:
            window = ndd.decoders.image_random_crop(data, device=device, output_type=DALIImageType.RGB,
                                                    random_area=area, random_aspect_ratio=ratio)
            cropped = ndd.resize(window, size=(augment.SIZE, augment.SIZE))
        mirror = ndd.random.coin_flip(probability=0.5, batch_size=spec.batch_size, dtype=ndd.int32)
        images_out = ndd.crop_mirror_normalize(cropped, mirror=mirror, dtype=ndd.float32,
                                               output_layout="CHW", mean=mean, std=std)
        return images_out.evaluate(), labels

    def labels(output) -> List[int]:
        images_out, labels_out = output
        _check_shape(spec, tuple(np.asarray(ndd.as_tensor(images_out.cpu())).shape))
        return [int(np.asarray(labels_out.select(k)).reshape(-1)[0]) for k in range(labels_out.batch_size)]

    return take, labels, getattr(source, "close", lambda: None)


def _check_shape(spec: ImageCellSpec, shape: Tuple[int, ...]) -> None:
    expected = (spec.batch_size, 3, augment.SIZE, augment.SIZE)
    if shape != expected:
        raise RuntimeError(f"{spec.loader}: a batch of images has shape {shape}, expected {expected}")


def _open_torch(spec: ImageCellSpec, images: ImageSet) -> Opened:
    from torch.utils.data import DataLoader, Dataset

    transform = augment.torchvision_transform() if spec.transforms == "torchvision" else None

    class JpegDataset(Dataset):
        """What a user writes: a map-style dataset opening each image with PIL, as ImageFolder does."""

        def __init__(self):
            self.paths = [images.path(i) for i in range(len(images))]
            self.labels = list(images.labels)

        def __len__(self) -> int:
            return 1 << 40  # cycles through the set; never exhausted within a cell

        def __getitem__(self, position: int):
            from PIL import Image

            k = position % len(self.paths)
            with open(self.paths[k], "rb") as f:
                image = Image.open(f).convert("RGB")
            if transform is not None:
                return transform(image), self.labels[k]
            rng = np.random.default_rng((AUGMENT_SEED, position))
            return augment.augment(image, rng), self.labels[k]

    loader = DataLoader(JpegDataset(), batch_size=spec.batch_size, num_workers=spec.workers,
                        persistent_workers=True, multiprocessing_context="fork")
    state = {"batches": iter(loader)}

    def take():
        batch = next(state["batches"])
        batch[0][0, 0, 0, 0]  # the consumer touches one value
        return batch

    def labels(batch) -> List[int]:
        _check_shape(spec, tuple(batch[0].shape))
        return [int(v) for v in batch[1]]

    def close():
        state.clear()  # the iterator's finaliser shuts the persistent workers down

    return take, labels, close


def _open_extsrc(spec: ImageCellSpec, images: ImageSet) -> Opened:
    import extsrc

    source = extsrc.ParallelSource(DecodedImages(images), spec.batch_size, num_outputs=2,
                                   num_workers=spec.workers, start_method="fork")
    batches = iter(source)

    def take():
        pictures, _labels = next(batches)
        pictures.as_array()[0, 0, 0, 0]  # the consumer touches one value of the dense batch
        return pictures, _labels

    def labels(batch) -> List[int]:
        pictures, label_batch = batch
        _check_shape(spec, pictures.as_array().shape)
        return [int(v) for v in label_batch.as_array().reshape(-1)]

    return take, labels, source.close


def open_image_loader(spec: ImageCellSpec, images: ImageSet) -> Opened:
    """Opens ``spec.loader`` on ``images``; see the module docstring."""
    if spec.loader in NDD_LOADERS:
        return _open_ndd(spec, images)
    if spec.loader in DALI_LOADERS:
        return _open_dali(spec, images)
    if spec.loader == TORCH:
        return _open_torch(spec, images)
    return _open_extsrc(spec, images)


def image_cell(fields: Dict[str, Any]) -> Dict[str, Any]:
    """Runs one image cell (in its own process): images/s and CPU use, after checking the labels."""
    from benchmarks.measure import measure

    spec = ImageCellSpec(**fields)
    images = load(spec.folder)
    take, labels, close = open_image_loader(spec, images)
    try:
        batches, elapsed, cpu, total, last = measure(take, spec.seconds, spec.warmup_s)
        got = labels(last)
        expected = expected_labels(images, total - 1, spec.batch_size)
        if got != expected:
            raise RuntimeError(f"{spec.loader}: batch {total - 1} holds labels {got[:4]}..., "
                               f"expected {expected[:4]}... (images out of order or lost)")
    finally:
        close()
    rate = batches * spec.batch_size / elapsed
    result = {"batches": batches, "elapsed_s": elapsed, "images_per_s": rate,
              **cpu}  # consumer_cpu, loader_cpu (cores used by the cell and its workers), other_cpu
    if cpu.get("loader_cpu"):
        result["images_per_core_s"] = rate / cpu["loader_cpu"]
    if "consumer_cpu" in cpu:
        result["consumer_ms_per_batch"] = cpu["consumer_cpu"] * elapsed / batches * 1e3  # steadier than images/s on a busy machine
    return result
