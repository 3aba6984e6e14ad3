"""The sender behind the gradient outbox: batches to the ``gradients`` topic, delivery reports
back into the read-your-writes pool and the offset gate.

Each ``GradientBatch`` (``outbox.py``) becomes one message, a compact ``RowBatch`` keyed by
its first row and produced to its partition. The message gets a token: its local steps are
assigned to it (``PendingSteps.assign``), and the offset gate (``offsets.py``) counts it as
produced. Its delivery report settles both: the steps learn the offset the message landed at
(an update that includes it then drops them), and the gate may release the events behind it.

A message librdkafka gives up on is produced again (after a wait that doubles up to 30 s),
as long as it takes: until it is delivered the gate holds the events it was learnt from, so
no failure commits an event whose gradients the parameter server will never see. A message
taken back before the broker had it (purged on a rebalance) withdraws its local steps from
the rows: the partition's next owner learns those events again.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
from confluent_kafka import KafkaError

from freshcore import metrics as m
from freshcore.kafka import ProducerFailed, produce
from freshcore.retry import RetryPolicy, RetryQueue
from inference.learning.outbox import GradientBatch
from inference.learning.pending import PendingSteps
from inference.offsets import OffsetGate
from inference.tables.cache import EmbeddingCache
from schemas.rowbatch import KIND_GRADIENTS, TABLE_NAMES, RowBatch
from schemas.rows import row_key

GRADIENT_RETRY = RetryPolicy(attempts=None, first_wait_s=2.0, max_wait_s=30.0)
"""A gradient message is produced until the broker takes it or its partition is revoked
(its events are not committed meanwhile), waiting 2, 4, 8 … 30 s between attempts."""
log = logging.getLogger("freshrec.worker")


class GradientSender:
    def __init__(
        self,
        producer,
        topic: str,
        pending: PendingSteps,
        gate: OffsetGate,
        cache: EmbeddingCache,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.pending = pending
        self.gate = gate
        self.cache = cache
        self.tokens = itertools.count(1)
        self._retries: RetryQueue[tuple[int, bytes, bytes, int, str, int]] = RetryQueue(
            GRADIENT_RETRY
        )
        """Messages whose delivery failed, to produce again: (token, value, key, partition,
        table name, rows)."""

    @property
    def retrying(self) -> int:
        """Messages waiting to be produced again."""
        return len(self._retries)

    def send(self, batches: list[GradientBatch], created_ms: int) -> None:
        for b in batches:
            token = next(self.tokens)
            self.pending.assign(b.steps, token)
            message = RowBatch(
                KIND_GRADIENTS,
                b.table,
                b.ids,
                b.sums.astype(np.float32, copy=False),
                b.counts.astype(np.uint64),
                b.newest_ms,
                created_ms=created_ms,
                oldest_ms=b.oldest_ms,
            )
            name = TABLE_NAMES[b.table]
            self.gate.produced(token)
            self._produce(
                token, message.encode(), row_key(int(b.ids[0])), b.partition, name, len(b.ids), 1
            )
            m.GRADIENT_ROWS.labels(name, "sent").inc(len(b.ids))
            m.GRADIENT_MESSAGES.labels("sent").inc()

    def _produce(self, token, value, key, partition, name, rows, attempt) -> None:
        produce(
            self.producer,
            self.topic,
            value,
            key,
            partition=partition,
            on_delivery=self._delivered(token, value, key, partition, name, rows, attempt),
        )

    def _delivered(self, token, value, key, partition, name, rows, attempt):
        def callback(err, msg) -> None:
            if err is None:
                self.gate.reported(token)
                for table, slots, deltas in self.pending.delivered(
                    token, msg.partition(), msg.offset()
                ):
                    self.cache.add(table, slots, (-deltas).astype(np.float32))
                return
            if err.fatal():  # the producer can send nothing more: the worker must restart
                raise ProducerFailed(f"gradients producer failed for good: {err}")
            if err.code() == KafkaError._PURGE_QUEUE:  # taken back on a rebalance
                self.gate.withdraw(token)  # its events are the next owner's to learn
                for table, slots, deltas in self.pending.withdrawn(token):
                    self.cache.add(table, slots, (-deltas).astype(np.float32))
                m.GRADIENT_MESSAGES.labels("withdrawn").inc()
                m.GRADIENT_ROWS.labels(name, "withdrawn").inc(rows)
                return
            # Not delivered (librdkafka gave up: the broker away longer than
            # message.timeout.ms). Produced again, and until then the events it was learnt
            # from are not committed: a crash makes the partition's next owner learn them.
            wait = GRADIENT_RETRY.wait_s(attempt)
            log.warning(
                "gradient message not delivered (%d %s rows, attempt %d): %s; again in %.0f s",
                rows,
                name,
                attempt,
                err,
                wait,
            )
            m.GRADIENT_MESSAGES.labels("retried").inc()
            m.PRODUCE_RETRIES.labels("gradients").inc()
            item = (token, value, key, partition, name, rows)
            self._retries.add(item, attempt, time.monotonic())

        return callback

    def withdraw_retries(self) -> int:
        """Partitions were revoked: the messages waiting to be produced again are withdrawn
        (their steps leave the rows; the next owner learns their events). How many."""
        retries = self._retries.drain()
        for (token, _, _, _, name, rows), _ in retries:
            self.gate.withdraw(token)
            for table, slots, deltas in self.pending.withdrawn(token):
                self.cache.add(table, slots, (-deltas).astype(np.float32))
            m.GRADIENT_MESSAGES.labels("withdrawn").inc()
            m.GRADIENT_ROWS.labels(name, "withdrawn").inc(rows)
        return len(retries)

    def retry_due(self, now: float) -> None:
        """Produce again the failed messages whose wait is over (from the loop)."""
        for (token, value, key, partition, name, rows), attempt in self._retries.due(now):
            self._produce(token, value, key, partition, name, rows, attempt)
