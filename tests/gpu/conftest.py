"""GPU tests of the PyTorch and CuPy layers: marked ``cuda``, skipped without an NVIDIA GPU
(by ``tests/conftest.py``)."""
