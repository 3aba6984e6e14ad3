"""The parameter server's edge: a ``gradients`` message decoded, or why it is skipped.

Validated here, trusted inside: a message applied before is skipped (a replay after a
restart); one that is corrupt, of another layout (kind or row width) or misrouted (rows of
other partitions, which live under another partition's hash tag in Redis) is skipped too,
counted and logged, and its offset counts as applied in its turn, so the partition goes on.
"""

from __future__ import annotations

import logging

import numpy as np

from freshcore import metrics as m
from freshcore.partitioner import row_partitions
from schemas.rowbatch import KIND_GRADIENTS, CorruptBatch, RowBatch

log = logging.getLogger("freshrec.param_server")


def decode_gradients(
    partition: int, offset: int, value: bytes, applied: int, width: int, shards: int
) -> RowBatch | bool:
    """The message's batch; ``False`` if it was applied before (at or below ``applied``, the
    partition's applied offset: skipped); ``True`` if it is corrupt or foreign (not
    gradients of rows ``width`` wide, or rows routed to other of the ``shards``
    partitions): skipped, and its offset counts as applied in its turn."""
    if offset <= applied:
        m.PS_SKIPPED.labels("already_applied").inc()
        return False
    try:
        batch = RowBatch.decode(value)
    except CorruptBatch as exc:
        m.PS_SKIPPED.labels("corrupt").inc()
        log.warning("gradients %d@%d corrupt, skipped: %s", partition, offset, exc)
        return True
    if batch.kind != KIND_GRADIENTS or batch.dim != width:
        m.PS_SKIPPED.labels("wrong_layout").inc()
        return True
    if shards > 1 and len(batch.ids):
        routed = row_partitions(np.asarray(batch.ids, np.int64), shards)
        if (routed != partition).any():  # its rows live under another partition's tag
            m.PS_SKIPPED.labels("misrouted").inc()
            log.warning(
                "gradients %d@%d has rows of other partitions (keyed by row id, murmur2), skipped",
                partition,
                offset,
            )
            return True
    return batch
