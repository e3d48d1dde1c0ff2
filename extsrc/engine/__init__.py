"""The engine: sources, the worker pool, workers, and the messages between them.

It knows nothing of DALI, Ray or PyTorch. See ``extsrc/README.md`` for the
layers and the life cycle of a batch.
"""
