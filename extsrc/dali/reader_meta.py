"""A parallel external source with an order, described to DALI's framework iterators as a reader.

DALI's iterators (``DALIGenericIterator``, ``DALIClassificationIterator``)
given ``reader_name=`` ask the pipeline for ``reader_meta(reader_name)`` and
from it decide how many batches an epoch has and how to treat the last one
(their ``last_batch_policy``). They expect a reader: every batch full, each
epoch restarting at the start of its shard (``pad_last_batch=True``), shards of
``epoch_size // number_of_shards`` samples.

A source with an :class:`~extsrc.Order` is such a reader when its batches are
all full: ``last_batch="drop"`` (the epoch is ``len(source) * batch_size``
samples) and ``last_batch="pad"`` (the epoch is the order's positions, the
last batch completed with records from the start of the epoch's order, which
the iterator keeps with ``FILL``, cuts off with ``PARTIAL`` and drops with
``DROP``). Every shard of an order has the same length, so the size reported is
that length times the number of shards: DALI's shard-size arithmetic then gives
every shard exactly its own length, and every rank the same number of batches.
``last_batch="partial"`` makes a shorter last batch, which those iterators
refuse ("Variable batch size is not supported"); asking for its metadata is an
error that says what to use instead.
"""

from __future__ import annotations

from typing import Any, Dict

from extsrc.engine import ParallelSource

META_KEYS = ("epoch_size", "epoch_size_padded", "number_of_shards", "shard_id", "pad_last_batch",
             "stick_to_shard")


def source_reader_meta(name: str, source: ParallelSource) -> Dict[str, Any]:
    """DALI's reader metadata for the parallel source named ``name``.

    Raises ``ValueError`` when the source has no order (its epoch length is
    unknown until the callback ends it) or makes a shorter last batch
    (``last_batch="partial"``), each time saying what to use instead.
    """
    order = source.spec.order
    if order is None:
        raise ValueError(
            f"reader_meta({name!r}): the parallel external source {name!r} has no order=, so the "
            "length of its epochs is known only when the callback raises StopIteration. Give it "
            "order=extsrc.Order(number_of_records) for reader_name=, or leave reader_name= and "
            "size= out of the iterator (it then runs each epoch until the source ends it)"
        )
    if source.last_batch == "partial":
        raise ValueError(
            f"reader_meta({name!r}): the parallel external source {name!r} has "
            "last_batch='partial', whose shorter last batch DALI's iterators refuse when "
            "reader_name= (or size=) is given. Use last_batch='pad' on the source, with "
            "LastBatchPolicy.PARTIAL on the iterator for a shorter last batch (it cuts the padding "
            "off), FILL to keep it full, or DROP to drop it; or leave reader_name= and size= out "
            "of the iterator to get the source's own shorter last batch"
        )
    index, count = order.shard
    if source.last_batch == "drop":
        per_shard = len(source) * source.batch_size
    else:  # "pad": the order's positions; the padding of the last batch is not counted
        per_shard = len(order)
    return {
        "epoch_size": per_shard * count,
        "epoch_size_padded": per_shard * count,
        "number_of_shards": count,
        "shard_id": index,
        "pad_last_batch": True,  # each epoch starts again at the start of the shard
        "stick_to_shard": True,  # an order's shard is fixed; its records change with the epoch
    }
