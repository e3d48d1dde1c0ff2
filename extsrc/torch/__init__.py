"""PyTorch on extsrc: batches as tensors, on the CPU without a copy or on a GPU by DMA.

* :class:`TorchLoader` wraps a :class:`~extsrc.ParallelSource`: tensors that
  are views of the batches' shared memory, the memory page-locked once for
  CUDA (``pin_memory=True``), CUDA tensors copied on a side stream
  (``device="cuda"``), ``len()``, ``state_dict()`` / ``load_state_dict()``.
* :func:`from_dataset` runs a map-style ``torch.utils.data.Dataset`` on the
  engine, with DataLoader's arguments: a one-line switch from a DataLoader.

Importing this module imports PyTorch (``pip install 'extsrc[torch]'``);
``import extsrc`` does not.
"""

from extsrc.torch.dataset import from_dataset
from extsrc.torch.loader import TorchLoader
from extsrc.torch.tensors import batch_tensors

__all__ = ["TorchLoader", "batch_tensors", "from_dataset"]
