"""What every tutorial script needs and none is about.

Each script's command line (an optional output folder, ``--gpu``), turning a
``pipe.run()`` result into NumPy images and labels, and saving them as an
``.npz`` so that the tests can compare a script on extsrc with the same script
on DALI's own imports. Scripts find this module next to themselves.
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np


def parse_args(doc: str, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """``out`` (folder to save into, or None) and ``gpu`` (decode with ``device="mixed"``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("EXTSRC_TUTORIAL_OUT"),
                        help="folder to save the decoded images and labels in (default: "
                             "$EXTSRC_TUTORIAL_OUT; unset: save nothing)")
    parser.add_argument("--gpu", action="store_true", help="decode on GPU 0 (device='mixed')")
    args = parser.parse_args(argv)
    if args.gpu:
        from extsrc.engine.cuda_state import gpu_visible

        visible, why = gpu_visible()
        if not visible:
            parser.error(f"--gpu decodes on a GPU, but {why}; run without --gpu to decode on the CPU")
    return args


def decoder_device(args: argparse.Namespace) -> Tuple[str, Optional[int]]:
    """``(decoder device, device_id)`` for the pipeline: GPU 0 with ``--gpu``, else the CPU."""
    return ("mixed", 0) if args.gpu else ("cpu", None)


def add_batch(images: List[np.ndarray], labels: List[int], out_images, out_labels) -> int:
    """Appends one ``run()`` result (decoded images, int32[1] labels); returns its batch size."""
    out_images = out_images.as_cpu()
    images += [np.array(out_images[i]) for i in range(len(out_images))]
    labels += [int(np.array(out_labels[i])[0]) for i in range(len(out_labels))]
    return len(out_images)


def save(out: Optional[str], script: str, images: List[np.ndarray], labels: List[int], **extra) -> None:
    """Saves ``OUT/<script name>.npz`` (labels, ``image_000``..., ``extra`` arrays) if ``out``."""
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, os.path.splitext(os.path.basename(script))[0] + ".npz")
    arrays = {key: np.array(value) for key, value in extra.items()}
    np.savez(path, labels=np.array(labels), **arrays,
             **{f"image_{i:03d}": image for i, image in enumerate(images)})
    print(f"saved {path}")
