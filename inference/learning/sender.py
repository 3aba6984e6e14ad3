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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class GradientMessage:
    """One gradient message as produced: what a failed delivery needs to produce it again,
    and what a withdrawal needs to take its steps back and count it."""

    token: int
    """The message's token: its local steps (``PendingSteps.assign``) and its place in the
    offset gate."""
    value: bytes
    """The encoded ``RowBatch``."""
    key: bytes
    """The key of its first row."""
    partition: int
    """The ``gradients`` partition it goes to (the outbox's)."""
    table: str
    """The name of the table its rows belong to (``TABLE_NAMES``), for the metrics."""
    rows: int
    """How many rows it carries."""


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
        self._retries: RetryQueue[GradientMessage] = RetryQueue(GRADIENT_RETRY)
        """Messages whose delivery failed, to produce again."""

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
                GradientMessage(
                    token, message.encode(), row_key(int(b.ids[0])), b.partition, name, len(b.ids)
                ),
                1,
            )
            m.GRADIENT_ROWS.labels(name, "sent").inc(len(b.ids))
            m.GRADIENT_MESSAGES.labels("sent").inc()

    def _produce(self, message: GradientMessage, attempt: int) -> None:
        produce(
            self.producer,
            self.topic,
            message.value,
            message.key,
            partition=message.partition,
            on_delivery=self._delivered(message, attempt),
        )

    def _delivered(self, message: GradientMessage, attempt: int):
        def callback(err, msg) -> None:
            if err is None:
                self.gate.reported(message.token)
                for table, slots, deltas in self.pending.delivered(
                    message.token, msg.partition(), msg.offset()
                ):
                    self.cache.add(table, slots, (-deltas).astype(np.float32))
                return
            if err.fatal():  # the producer can send nothing more: the worker must restart
                raise ProducerFailed(f"gradients producer failed for good: {err}")
            if err.code() == KafkaError._PURGE_QUEUE:  # taken back on a rebalance
                self._withdraw(message)  # its events are the next owner's to learn
                return
            # Not delivered (librdkafka gave up: the broker away longer than
            # message.timeout.ms). Produced again, and until then the events it was learnt
            # from are not committed: a crash makes the partition's next owner learn them.
            wait = GRADIENT_RETRY.wait_s(attempt)
            log.warning(
                "gradient message not delivered (%d %s rows, attempt %d): %s; again in %.0f s",
                message.rows,
                message.table,
                attempt,
                err,
                wait,
            )
            m.GRADIENT_MESSAGES.labels("retried").inc()
            m.PRODUCE_RETRIES.labels("gradients").inc()
            self._retries.add(message, attempt, time.monotonic())

        return callback

    def withdraw_retries(self) -> int:
        """Partitions were revoked: the messages waiting to be produced again are withdrawn
        (their steps leave the rows; the next owner learns their events). How many."""
        retries = self._retries.drain()
        for message, _ in retries:
            self._withdraw(message)
        return len(retries)

    def _withdraw(self, message: GradientMessage) -> None:
        """A message the broker will not get from this worker: the gate lets its events go
        uncommitted, its steps leave the rows."""
        self.gate.withdraw(message.token)
        for table, slots, deltas in self.pending.withdrawn(message.token):
            self.cache.add(table, slots, (-deltas).astype(np.float32))
        m.GRADIENT_MESSAGES.labels("withdrawn").inc()
        m.GRADIENT_ROWS.labels(message.table, "withdrawn").inc(message.rows)

    def retry_due(self, now: float) -> None:
        """Produce again the failed messages whose wait is over (from the loop)."""
        for message, attempt in self._retries.due(now):
            self._produce(message, attempt)
