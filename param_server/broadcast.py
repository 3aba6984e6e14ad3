"""The update broadcast: rows a transaction persisted, out on ``embeddings.updates``.

Every worker reads every partition of ``embeddings.updates``. A ``gradients`` partition's
rows go to the update partition of the same number (modulo their count), in batches of at
most ``MAX_ROWS_PER_MESSAGE`` rows, each carrying the (partition, offset) of the log it
includes. Rows are broadcast only once Redis holds them (the parameter server sends them when
its transaction is in), so a delivered update's offset is a place a starting worker may begin
to follow the broadcast: those start positions are kept per partition and written to Redis
once per loop round (``save_positions``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np

from freshcore import clock
from freshcore import metrics as m
from freshcore.kafka import partition_count, produce
from freshcore.outage import is_outage
from freshcore.rediskeys import RedisKeys
from schemas.rowbatch import KIND_UPDATES, RowBatch

log = logging.getLogger("freshrec.param_server")
MAX_ROWS_PER_MESSAGE = 1000
"""Rows per update message at most: far below Kafka's default 1 MB message limit."""

Snapshot = dict[int, dict[int, tuple[np.ndarray, ...]]]
"""partition -> table -> (ids, rows, accumulators, versions, event times)."""


def update_batches(
    snapshot: Snapshot,
    offsets: dict[int, int],
    oldest: dict[int, dict[int, np.ndarray]],
    created_ms: int,
) -> Iterator[tuple[int, RowBatch]]:
    """The update batches of a persisted snapshot, each with its ``gradients`` partition:
    per partition and table, chunks of at most ``MAX_ROWS_PER_MESSAGE`` rows that report
    the partition's applied offset (``offsets``) and each row's oldest event time
    (``oldest``).

    >>> ids = np.arange(1500)
    >>> snap = {3: {0: (ids, np.zeros((1500, 2), np.float32), None,
    ...                 np.ones(1500, np.uint64), np.zeros(1500, np.int64))}}
    >>> [(p, len(b), b.offset) for p, b in update_batches(snap, {3: 41}, {3: {0: ids}}, 0)]
    [(3, 1000, 41), (3, 500, 41)]
    """
    for p, tables in snapshot.items():
        for t, (ids, rows, _, versions, event_ms) in tables.items():
            for lo in range(0, len(ids), MAX_ROWS_PER_MESSAGE):
                chunk = slice(lo, lo + MAX_ROWS_PER_MESSAGE)
                yield (
                    p,
                    RowBatch(
                        KIND_UPDATES,
                        t,
                        ids[chunk],
                        rows[chunk],
                        versions[chunk],
                        event_ms[chunk],
                        partition=p,
                        offset=offsets[p],
                        created_ms=created_ms,
                        oldest_ms=oldest[p][t][chunk],
                    ),
                )


class UpdateBroadcast:
    """Sends persisted rows on ``embeddings.updates``; each delivery report goes to
    ``on_delivery`` (``record_delivery`` keeps the start positions it gives)."""

    def __init__(
        self, producer, topic: str, half: bool, on_delivery: Callable[[object, object], None]
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.half = half
        """Rows as float16 (``RowBatch.encode(half=True)``: ``FRESHREC_UPDATES_FP16``)."""
        self.on_delivery = on_delivery
        self.partitions = 1
        """``embeddings.updates`` partitions (read at ``start``)."""

    def start(self) -> None:
        self.partitions = partition_count(self.producer, self.topic)

    def send(
        self,
        snapshot: Snapshot,
        offsets: dict[int, int],
        oldest: dict[int, dict[int, np.ndarray]],
    ) -> None:
        """Broadcast a snapshot Redis holds (``update_batches``), then serve delivery reports
        already in."""
        for p, batch in update_batches(snapshot, offsets, oldest, clock.now_ms()):
            self._produce(batch.encode(half=self.half), p % self.partitions)
        self.producer.poll(0)

    def _produce(self, value: bytes, partition: int) -> None:
        produce(self.producer, self.topic, value, partition=partition, on_delivery=self.on_delivery)


def record_delivery(positions: dict[int, int], err, msg) -> None:
    """Count a delivery report and keep, per update partition, the newest offset delivered
    (in ``positions``, until ``save_positions`` writes it)."""
    if err is not None:
        # the rows are persisted; workers see them at their next update, or load them
        # from Redis when they start
        log.warning("update broadcast failed: %s", err)
        m.PS_BROADCASTS.labels("failed").inc()
        return
    m.PS_BROADCASTS.labels("delivered").inc()
    p = msg.partition()
    positions[p] = max(positions.get(p, -1), msg.offset())


def save_positions(redis, keys: RedisKeys, positions: dict[int, int]) -> dict[int, int]:
    """Write where a starting worker may begin to follow the broadcast: the offset of an
    update already delivered (so persisted), per partition, in one write. Returns the
    positions still to write: none once written, all of them while Redis is down or refusing
    (at maxmemory), for the next round. Only a start position: one written late or lost
    makes a new worker replay more updates, which it installs only where they are newer."""
    if not positions:
        return positions
    try:
        redis.hset(keys.ps_broadcast, mapping=positions)
    except Exception as exc:  # down, or refusing (at maxmemory): the next round writes them
        if not is_outage(exc):
            raise
        return positions
    return {}
