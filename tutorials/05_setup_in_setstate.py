"""Tutorial 5: do the heavy setup in the worker, in ``__setstate__``.

With ``spawn`` the source object is pickled in the main process and unpickled
once in every worker. Whatever it holds travels that way, and some things
cannot: open files, database handles, memory maps, locks. Others can but
should not: a large index, loaded once in the main process only to be copied
to every worker.

So the object below carries only the path of its data. ``__getstate__`` says
what is pickled (the path), ``__setstate__`` runs in each worker when the
object arrives and does the setup there: it opens the pack file and reads its
index. The main process never opens the pack. ``__call__`` also opens it on
first use, so the same object works with ``fork`` (nothing is pickled then)
and when called directly.

The data is a "pack": all bundled JPEGs back to back in one file, plus an
index of offsets, sizes and labels, as large data sets are often stored.

Run: ``python tutorials/05_setup_in_setstate.py [OUT_DIR] [--gpu]``
"""

import os
import shutil
import tempfile
from importlib.resources import files

import numpy as np
from nvidia.dali import types

from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8


def write_pack(data_dir: str, folder: str) -> str:
    """Writes ``images.pack`` and ``images.index.npy`` (offset, size, label rows) to ``folder``."""
    pack_path = os.path.join(folder, "images.pack")
    rows = []
    with open(os.path.join(data_dir, "labels.txt")) as labels, open(pack_path, "wb") as pack:
        for name, label in (line.split() for line in labels):
            with open(os.path.join(data_dir, "images", name), "rb") as f:
                data = f.read()
            rows.append((pack.tell(), len(data), int(label)))
            pack.write(data)
    np.save(os.path.join(folder, "images.index.npy"), np.array(rows, dtype=np.int64))
    return pack_path


class PackReader:
    """Sample ``i`` of an epoch: (bytes of the i-th JPEG of the pack, its label)."""

    def __init__(self, pack_path: str):
        self.pack_path = pack_path
        self._pack = None  # opened where the samples are read, not here
        self._index = None

    def __getstate__(self):
        return {"pack_path": self.pack_path}

    def __setstate__(self, state):
        self.__init__(state["pack_path"])
        self._open()

    def _open(self):
        self._index = np.load(self.pack_path.replace(".pack", ".index.npy"))
        self._pack = open(self.pack_path, "rb")
        print(f"process {os.getpid()}: opened {os.path.basename(self.pack_path)}, "
              f"{len(self._index)} samples", flush=True)

    def __call__(self, info):
        if self._pack is None:
            self._open()
        if info.idx_in_epoch >= len(self._index):
            raise StopIteration
        offset, size, label = self._index[info.idx_in_epoch]
        self._pack.seek(offset)
        encoded = np.frombuffer(self._pack.read(size), dtype=np.uint8)
        return encoded, np.array([label], dtype=np.int32)


@pipeline_def(batch_size=BATCH_SIZE, num_threads=2, py_num_workers=2, py_start_method="spawn")
def jpeg_pipeline(source, decoder_device):
    jpegs, labels = fn.external_source(
        source=source, num_outputs=2, batch=False, parallel=True, dtype=[types.UINT8, types.INT32]
    )
    return fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB), labels


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)

    folder = tempfile.mkdtemp(prefix="extsrc-tutorial-")
    try:
        reader = PackReader(write_pack(DATA_DIR, folder))
        print(f"main process {os.getpid()}: building the pipeline; the pack is not opened here")
        device, device_id = tutorial_io.decoder_device(args)
        pipe = jpeg_pipeline(reader, device, device_id=device_id)
        pipe.build()
        images, labels = [], []
        for _ in range(3):
            out_images, out_labels = pipe.run()
            tutorial_io.add_batch(images, labels, out_images, out_labels)
        assert reader._pack is None, "the main process opened the pack"
        print(f"{len(images)} images read from the pack by the workers; labels {labels}")
    finally:
        shutil.rmtree(folder)

    tutorial_io.save(args.out, __file__, images, labels)


if __name__ == "__main__":
    main()
