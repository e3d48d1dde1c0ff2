"""PyTorch on extsrc: :class:`TorchLoader`, a ``ParallelSource``'s batches as tensors (views of
the shared memory, page-locked once for CUDA, or copied to a GPU on a side stream), and
:func:`from_dataset`, a ``Dataset`` run on the engine with DataLoader's arguments (a one-line
switch from a DataLoader). Importing it imports PyTorch (``pip install 'extsrc[torch]'``);
``import extsrc`` does not.
"""

from extsrc.torch.dataset import from_dataset
from extsrc.torch.loader import TorchLoader
from extsrc.torch.tensors import batch_tensors

__all__ = ["TorchLoader", "batch_tensors", "from_dataset"]
