"""extsrc's benchmarks: not installed with the package; ``python -m benchmarks`` from a checkout's top
folder, or ``python -m extsrc bench`` when extsrc is imported from that checkout."""
