"""The kinds of source, told apart once where the source is made and read on both sides.

The consumer (``ParallelSource``, the producer: whether a source is pinned to one
worker, whether it can resume mid-epoch) and the worker (the runner: how the
callback is called) read the same :data:`SourceKind`; neither imports the other.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

SourceKind = Literal["sample", "callable", "iterable", "generator"]
SAMPLE: SourceKind = "sample"  # sample mode: source(SampleInfo) -> one sample
BATCH_CALLABLE: SourceKind = "callable"  # batch mode: source(iteration or BatchInfo) -> a batch
BATCH_ITERABLE: SourceKind = "iterable"  # batch mode: each item of iter(source) is a batch
BATCH_GENERATOR: SourceKind = "generator"  # batch mode: each item of source() is a batch
# Kinds whose state lives in the one worker that runs them (pinned), and that cannot be
# rewound to resume in the middle of an epoch.
STREAMS = (BATCH_ITERABLE, BATCH_GENERATOR)
# A source as the user gave it: a callable, an iterable or a generator function, told apart by
# classify(). Untyped: what it takes and gives is the user's, checked where it is used.
Source = Any


def classify(source: Source, batch: bool) -> SourceKind:
    """The kind of a source; raises ``TypeError`` for one that fits no mode."""
    if not batch:
        if not callable(source):
            raise TypeError(
                f"in sample mode (batch=False) the source must be a callable taking a "
                f"SampleInfo, got {type(source).__name__}; iterables and generators need batch=True"
            )
        return SAMPLE
    if inspect.isgeneratorfunction(source):
        return BATCH_GENERATOR
    if callable(source):
        return BATCH_CALLABLE
    if hasattr(source, "__iter__"):
        return BATCH_ITERABLE
    raise TypeError(
        f"the source must be a callable, an iterable or a generator function, got "
        f"{type(source).__name__}"
    )
